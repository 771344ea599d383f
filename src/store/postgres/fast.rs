//! A batch as one statement (SPEC §13): no `BEGIN`, no read, no `COMMIT` of its own.
//!
//! A batch made under lock costs two round trips and the flush at least (the rows read and
//! locked, then the last statement with the `COMMIT`), and a claim under the twin guard two
//! more (the twin keys' locks, the twin slots' read). Most batches need none of those reads:
//! a fresh claim is decided on nothing stored (its id and its twin slot are new), and a
//! settlement on the record this proxy's own claim wrote a moment before. So the writer holds
//! the records its claims wrote, decides such a batch without reading, and sends its rows, its
//! counts and its log as the batch's last statement alone, which is then the whole transaction:
//! one round trip and the flush. When another proxy moves the log's head, `BEGIN`, the rows
//! and the head's read under lock go out together, then the counts and the log with the
//! `COMMIT` ([`super::commit::rows_then_log`]): two round trips, where a batch under lock takes
//! four or five, and the head held as briefly.
//!
//! What was assumed is checked by that statement, under the rows' locks: a new action is
//! inserted only where its id and its twin slot are free (its twin key's lock taken first, as a
//! claim under lock takes it), and a settled row is written only where it still holds the
//! record this proxy wrote (another proxy that took the action over changed it). When anything
//! assumed no longer holds, nothing is written, and the batch is made again under lock, as
//! the writer's batches are for a second after (a replayed key's claim finds its action stored).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batch::{settled, Done, Op, Writer};
use super::commit::{Ending, Sending};
use super::sets::{Kind, Rows};
use super::Moves;
use crate::action::{decide_claim, Millis, Record};
use crate::log::LogEvent;
use crate::store::{claim_events, StoreError};

/// At most this many records held (a few MiB); past it the oldest is forgotten, and its
/// settlement decided under lock. Only writes in flight are held, so this many are in flight
/// at once only when the upstream is slow (a thousand writes a second answered in eight
/// seconds), or when settlements fail (the database away).
const HELD_MAX: usize = 8_192;

/// How long after a batch found what it assumed no longer held the writer decides under lock.
const STALE_FOR: Duration = Duration::from_secs(1);

/// A record as this proxy's writer last committed it, and its text as stored.
struct Held {
    record: Record,
    text: String,
}

/// What the writer remembers between batches to decide them without reading.
#[derive(Default)]
pub(super) struct Memory {
    held: HashMap<String, Held>,
    /// The ids held, oldest first; some may have been forgotten since.
    order: VecDeque<String>,
    /// What the batch being made under lock will hold once it commits.
    pending: Vec<Held>,
    /// Until when batches are made under lock.
    stale_until: Option<Instant>,
}

impl Memory {
    /// Forgets what it held of `ops`' actions: a batch made under lock changes them.
    pub(super) fn forget(&mut self, ops: &[Op]) {
        for op in ops {
            self.held.remove(op.id());
        }
        self.pending.clear();
    }

    /// Holds `record`, stored as `text`, once the batch under lock commits.
    pub(super) fn hold_after_commit(&mut self, record: Record, text: String) {
        self.pending.push(Held { record, text });
    }

    /// The batch under lock committed: what it will hold is held.
    pub(super) fn committed(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        self.hold(pending);
    }

    fn hold(&mut self, records: Vec<Held>) {
        for h in records {
            self.order.push_back(h.record.id.clone());
            self.held.insert(h.record.id.clone(), h);
        }
        while self.held.len() > HELD_MAX {
            match self.order.pop_front() {
                Some(id) => drop(self.held.remove(&id)),
                None => break,
            }
        }
        // Ids settled since they were held: dropped once they outnumber those held.
        if self.order.len() > 2 * self.held.len().max(HELD_MAX / 8) {
            let held = &self.held;
            self.order.retain(|id| held.contains_key(id));
        }
    }
}

/// A batch decided without reading: each operation's answer, and what the statement writes.
struct Plan {
    done: Vec<Result<Done, StoreError>>,
    rows: Rows,
    events: Vec<LogEvent>,
    moves: Moves,
    /// The records the batch's claims write, with their text.
    fresh: Vec<Held>,
}

impl Writer {
    /// Makes the batch without reading its rows when every operation of it can be decided so
    /// (a fresh claim, a settlement of an action this proxy claimed, an audit note, each alone
    /// on its action and twin key) and the database's clock is known: as one statement when the
    /// log's head is this proxy's own, or else with the head read under lock after the rows.
    /// `None`: it cannot, and nothing was sent.
    pub(super) async fn alone(
        &self,
        c: &deadpool_postgres::Client,
        ops: &[Op],
    ) -> Option<Result<Vec<Result<Done, StoreError>>, Ending>> {
        let db_now = self.db_now(c).await.ok()?;
        let now = |op: &Op| db_now.unwrap_or_else(|| op.given());
        let Plan {
            done,
            rows,
            events,
            moves,
            fresh,
        } = self.plan(ops, now)?;
        let head = self.chain_after();
        let made = match head {
            Some(_) => &self.batches.one_statement,
            None => &self.batches.head_locked,
        };
        let last = self.last(&rows, &moves, events);
        let written = match head {
            Some(head) => last.commit(c, Some(head), Sending::Alone).await,
            // Another proxy moves the head: it is read under lock, after the rows.
            None => {
                let written = last.rows_then_log(c).await;
                if let Err(Ending::Stale | Ending::LockCycle) = written {
                    if c.batch_execute("ROLLBACK").await.is_err() {
                        return Some(Err(Ending::Failed(super::unavailable(
                            "could not roll back a batch",
                        ))));
                    }
                }
                written
            }
        };
        let mut memory = self.memory();
        match written {
            Ok(head) => {
                self.keep_head(head, false);
                memory.forget(ops);
                memory.hold(fresh);
                made.inc();
                Some(Ok(done))
            }
            Err(e) => {
                match e {
                    // Nothing was written, and what it held may still hold: the row check
                    // says so when the batch is made again.
                    Ending::HeadMoved => {}
                    Ending::Stale | Ending::LockCycle => {
                        memory.forget(ops);
                        memory.stale_until = Some(Instant::now() + STALE_FOR);
                    }
                    Ending::Failed(_) => {
                        memory.forget(ops);
                        self.keep_head(None, true);
                    }
                }
                Some(Err(e))
            }
        }
    }

    pub(super) fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The batch decided without reading, or `None` when it cannot be.
    fn plan(&self, ops: &[Op], now: impl Fn(&Op) -> Millis) -> Option<Plan> {
        let sealer = self.sealer.as_deref();
        let mut memory = self.memory();
        if let Some(until) = memory.stale_until {
            if Instant::now() < until {
                return None;
            }
            memory.stale_until = None;
        }
        // Each operation alone on its action and its twin key.
        let (mut ids, mut twins) = (HashSet::new(), HashSet::new());
        for op in ops {
            if matches!(op, Op::Note(..)) {
                continue;
            }
            if !ids.insert(op.id()) || op.twin_key().is_some_and(|k| !twins.insert(k)) {
                return None;
            }
        }
        let mut plan = Plan {
            done: Vec::with_capacity(ops.len()),
            rows: Rows::default(),
            events: Vec::new(),
            moves: Moves::default(),
            fresh: Vec::new(),
        };
        for op in ops {
            let done = match op {
                Op::Note(ev) => {
                    plan.events.push((**ev).clone());
                    Done::Note
                }
                Op::Claim(req, _) => {
                    let mut req = (**req).clone();
                    req.now = now(op);
                    let (claim, write) = decide_claim(None, None, &req);
                    let w = write?;
                    let text = plan.rows.push_as(Kind::Fresh, &w, None, sealer, None);
                    let text = text.to_string();
                    plan.moves.moved(None, Some(w.state));
                    let events = claim_events(&claim, &w);
                    plan.events.extend(events.into_iter().map(LogEvent::from));
                    plan.fresh.push(Held { record: w, text });
                    Done::Claim(claim)
                }
                Op::Settle(req, _) => {
                    let held = memory.held.get(&req.id)?;
                    let ch = &mut (&mut plan.events, &mut plan.moves);
                    let new = settled(req, Some(held.record.clone()), now(op), ch).ok()?;
                    let old = Some(held.text.clone());
                    plan.rows
                        .push_as(Kind::Checked, &new, req.body.as_ref(), sealer, old);
                    Done::Settle(Arc::new(new))
                }
                Op::Resolve(..) => return None,
            };
            plan.done.push(Ok(done));
        }
        Some(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: &str) -> Held {
        Held {
            record: Record::new(id, "f"),
            text: format!("text of {id}"),
        }
    }

    #[test]
    fn holds_the_newest_records_within_its_bound() {
        let mut m = Memory::default();
        m.hold((0..HELD_MAX + 10).map(|i| held(&format!("a{i}"))).collect());
        assert_eq!(m.held.len(), HELD_MAX);
        assert!(!m.held.contains_key("a0") && !m.held.contains_key("a9"));
        assert!(m.held.contains_key("a10"));
        assert!(m.held.contains_key(&format!("a{}", HELD_MAX + 9)));
    }

    #[test]
    fn forgets_what_was_settled_and_keeps_its_ids_bounded() {
        let mut m = Memory::default();
        // Many more writes than it may hold, each settled right after: a settlement's batch
        // forgets what it held, and the list of ids does not grow with them.
        for i in 0..10 * HELD_MAX {
            let id = format!("w{i}");
            m.hold(vec![held(&id)]);
            m.held.remove(&id);
        }
        assert!(m.held.is_empty());
        assert!(m.order.len() <= HELD_MAX / 4 + 1, "{}", m.order.len());
        // What is held is still found, and a batch made under lock holds only once committed.
        m.hold_after_commit(Record::new("p1", "f"), "t".into());
        assert!(m.held.is_empty());
        m.committed();
        assert_eq!(m.held["p1"].text, "t");
    }
}
