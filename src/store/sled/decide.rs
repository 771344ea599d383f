//! What the writer decides for each operation of a batch, and the sweeps it makes (expiry, the
//! write log's retention).

use super::*;

impl Writer {
    /// One step of expiry: the due entries of the expiry index after `from`, until they list
    /// [`EXPIRE_STEP`] actions. The index is read from sled, which may lack the last batches
    /// (the drainer applies them behind the writer). Entries are written once, by the batch
    /// that settled their actions, and changed only by expiry, so what sled lacks is entries not
    /// yet due (an action expires a retention after it settled; the drainer is seconds behind at
    /// most) and a previous sweep's own changes, which a second pass repeats to the same effect
    /// (records are read through the writer's view, so an action expired is gone). Only when a
    /// batch sled lacks holds a record already due (a clock moved on, a drainer stalled) does
    /// the first step wait until sled holds every change: a wait a sweep under load would
    /// otherwise make every write behind it share. Of each entry's actions, those due expire if
    /// their record still expires then (one that moved on since, or went, is left out); the
    /// entry goes, or, for what is not yet due, is put again under its earliest expiry.
    pub(super) fn expire_step(
        &mut self,
        pending: &mut Pending,
        now: Millis,
        from: Option<Vec<u8>>,
    ) -> Result<(usize, Option<Vec<u8>>), StoreError> {
        let start = match from {
            Some(k) => k,
            None => {
                let due_unapplied = self.unapplied.values().any(|(_, r, _)| {
                    r.as_ref()
                        .is_some_and(|r| r.expires_at.is_some_and(|at| at <= now))
                });
                if due_unapplied {
                    self.settle_down().map_err(unavailable)?;
                }
                EXPIRY_PREFIX.to_vec()
            }
        };
        let (mut entries, mut listed) = (Vec::new(), 0);
        let mut last = None;
        for kv in self.db.range(start..expiry_end(now)) {
            let (k, v) = kv.map_err(unavailable)?;
            let (tag, actions) = expiring(&k, &v)?;
            listed += actions.len();
            last = Some(k.to_vec());
            entries.push((k, tag, actions));
            if listed >= EXPIRE_STEP {
                break;
            }
        }
        let mut n = 0;
        let mut freed = Vec::new();
        for (k, tag, actions) in entries {
            let mut kept = Vec::new();
            for due in actions {
                if due.at > now {
                    kept.push(due);
                    continue;
                }
                let found = match due.created {
                    Some(created) => self.read_at(pending, &due.id, created)?,
                    None => self.read(pending, &due.id)?,
                };
                let Some(r) = found else {
                    continue;
                };
                if r.expires_at != Some(due.at) {
                    // It expires at another time now, under another entry.
                    continue;
                }
                if !r.is_expired(now) {
                    // Only settled records expire: one not settled (kept with an expiry by an
                    // older version) stays listed.
                    kept.push(due);
                    continue;
                }
                self.unstage(pending, &r);
                self.append(
                    pending,
                    LogEvent::for_record(Event::Expired, &r, Actor::Proxy),
                );
                freed.extend(body_file(&r).map(str::to_string));
                n += 1;
            }
            match tag {
                // One action's entry, as versions before kept it: it goes once its action does.
                None if kept.is_empty() => pending.del(&*k),
                None => {}
                Some(tag) => {
                    pending.del(&*k);
                    if let Some((key, value)) = expiry_entry(&kept, tag) {
                        pending.put(key, value);
                    }
                }
            }
        }
        // Body files are shared by content: one goes when no record keeps it and no settlement
        // is placing it.
        for sha in freed {
            let placed = self.placing.lock().is_ok_and(|p| p.contains_key(&sha));
            if !placed && !self.file_kept(pending, &sha)? {
                let _ = std::fs::remove_file(self.dir.join("bodies").join(&sha));
            }
        }
        let Some(mut next) = last.filter(|_| listed >= EXPIRE_STEP) else {
            return Ok((n, None));
        };
        next.push(0);
        Ok((n, Some(next)))
    }

    /// Whether any record keeps its response in body file `sha`: those sled's index names (as
    /// they are now), and those changed by batches not yet in sled.
    pub(super) fn file_kept(&self, pending: &Pending, sha: &str) -> Result<bool, StoreError> {
        let keeps = |r: &Option<Arc<Record>>| r.as_deref().and_then(body_file) == Some(sha);
        let newer = self
            .unapplied
            .iter()
            .filter(|(id, _)| !pending.records.contains_key(*id))
            .map(|(_, (_, r, _))| r);
        if pending.records.values().chain(newer).any(keeps) {
            return Ok(true);
        }
        let prefix = file_key(sha, "");
        for k in self.db.scan_prefix(&prefix).keys() {
            let k = k.map_err(unavailable)?;
            let id = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
            if keeps(&self.read(pending, &id)?) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    pub(super) fn apply(&mut self, op: Op, pending: &mut Pending) -> Answer {
        if op.needs_flush() {
            pending.durable = true;
        }
        match op {
            Op::Claim(req, tx) => match self.read(pending, &req.fresh.id) {
                Err(e) => Answer::failed(tx, e),
                Ok(current) => {
                    let old = current.clone();
                    let replaced = old.as_deref().is_some_and(|o| req.replaces(o));
                    // The unsettled action holding this write's twin slot, if any (SPEC §4.1).
                    let holder = req
                        .twin_key()
                        .and_then(|k| self.twins.holder(k))
                        .map(str::to_string);
                    let twin = match holder.map(|id| self.read(pending, &id)) {
                        None => None,
                        Some(Ok(r)) => r,
                        Some(Err(e)) => return Answer::failed(tx, e),
                    };
                    let twin_key = req.twin.as_ref().map(|t| t.key.clone());
                    let (claim, write) =
                        decide_claim_owned(current.map(Arc::unwrap_or_clone), twin, *req);
                    // A new attempt of a failed action keeps the response stored with it.
                    let kept = match write {
                        true => self.kept_body(pending, old.as_deref(), claim.record()),
                        false => Ok(None),
                    };
                    let kept = match kept {
                        Ok(k) => k,
                        Err(e) => return Answer::failed(tx, e),
                    };
                    let mut claim = claim;
                    if write {
                        // An expired record being replaced (or, under a fingerprint key, one past
                        // its `fingerprint_window`) loses its stored body and indexes.
                        let expired = old.as_deref().filter(|_| replaced);
                        if let Some(o) = expired {
                            self.unstage(pending, o);
                            self.append(
                                pending,
                                LogEvent::for_record(Event::Expired, o, Actor::Proxy),
                            );
                        }
                        let live_old = if expired.is_some() {
                            None
                        } else {
                            old.as_deref()
                        };
                        let kept = kept.filter(|_| live_old.is_some());
                        // The claim's own record, shared with the batch (and so with the cache).
                        self.claim_twin_key = twin_key;
                        let w = self.stage(pending, live_old, Arc::clone(claim.record()), kept);
                        self.claim_twin_key = None;
                        if old.is_none() {
                            // A new action: no batch ever put its state entry.
                            pending.new_keys.insert(state_key(w.state, &w.id));
                        }
                        for ev in claim_events(&claim, &w) {
                            self.append_record(pending, &ev);
                        }
                        claim = claim.with_record(w);
                    }
                    Answer::Claim(tx, Box::new(claim))
                }
            },
            Op::Settle(req, tx) => {
                let SettleRequest {
                    id,
                    attempt,
                    settlement,
                    body,
                } = *req;
                let result = self.change(pending, &id, body.as_ref(), |current| {
                    apply_settle(current, &id, attempt, settlement)
                });
                match result {
                    Err(e) => Answer::failed(tx, e),
                    Ok(change) => {
                        Answer::Record(tx, self.commit(pending, change, body, settle_event))
                    }
                }
            }
            Op::Resolve(id, mut res, event, tx) => {
                let (actor, reason) = match event {
                    Event::Lookup => (Actor::Lookup, res.reason.clone()),
                    _ => (Actor::Admin, res.reason.clone()),
                };
                let body = res.body.take();
                let result = self.change(pending, &id, body.as_ref(), |current| {
                    apply_resolve(current, &id, *res)
                });
                match result {
                    Err(e) => Answer::failed(tx, e),
                    Ok(change) => Answer::Record(
                        tx,
                        self.commit(pending, change, body, |new| {
                            resolve_event(event, new, actor, reason)
                        }),
                    ),
                }
            }
            Op::Notes => {
                // Notes wait a little for company (see `batch`). The batch the timer makes
                // for them took them all: nothing waits then, and nothing is armed (else every
                // notes batch armed the next, and the writer woke for good).
                if self.notes_waiting() > 0 {
                    self.notes_due
                        .get_or_insert_with(|| Instant::now() + NOTES_WAIT);
                }
                Answer::None
            }
            Op::Recover(owner, now, tx) => {
                let filter = Filter {
                    state: Some(State::InFlight),
                    ..Filter::default()
                };
                let found = self.settle_down().map_err(unavailable).and_then(|()| {
                    // Everything is applied: sled alone is the whole store.
                    let nothing = Overlay::take(&self.shared, |_| false)?;
                    scan(
                        &self.db,
                        &self.shared.buckets,
                        &nothing,
                        &filter,
                        usize::MAX,
                        self.sealer.as_deref(),
                    )
                });
                match found {
                    Err(e) => Answer::failed(tx, e),
                    Ok(records) => {
                        let mut n = 0;
                        for r in records {
                            // An earlier operation of this batch may have changed it.
                            let Ok(Some(r)) = self.read(pending, &r.id) else {
                                continue;
                            };
                            if owner.as_ref().is_some_and(|o| r.owner.as_ref() != Some(o)) {
                                continue;
                            }
                            let old = r.clone();
                            let reason = if owner.is_some() {
                                "the proxy stopped (drain_timeout) during this attempt; the request may have reached the upstream"
                            } else {
                                "the proxy stopped during this attempt; the request may have reached the upstream"
                            };
                            if let Some(new) =
                                recover_in_flight(Arc::unwrap_or_clone(r), reason, now)
                            {
                                let kept = match self.kept_body(pending, Some(&old), &new) {
                                    Ok(k) => k,
                                    Err(e) => return Answer::failed(tx, e),
                                };
                                let new = self.stage(pending, Some(&old), Arc::new(new), kept);
                                self.append_record(pending, &recover_event(&new, reason));
                                n += 1;
                            }
                        }
                        Answer::Count(tx, n)
                    }
                }
            }
            Op::Expire(now, from, tx) => match self.expire_step(pending, now, from) {
                Ok((n, next)) => Answer::Step(tx, n, next),
                Err(e) => Answer::failed(tx, e),
            },
            Op::Sync(tx) => Answer::Unit(tx),
            Op::Renew(id, owner, until, tx) => match self.read(pending, &id) {
                Err(e) => Answer::failed(tx, e),
                Ok(Some(r)) if r.state == State::InFlight && r.owner.as_ref() == Some(&owner) => {
                    let mut new = Record::clone(&r);
                    new.lease_until = Some(until);
                    match self.kept_body(pending, Some(&r), &new) {
                        Ok(kept) => {
                            self.stage(pending, Some(&r), Arc::new(new), kept);
                            Answer::Bool(tx, true)
                        }
                        Err(e) => Answer::failed(tx, e),
                    }
                }
                Ok(_) => Answer::Bool(tx, false),
            },
        }
    }

    /// The next version of record `id`, made by `next` from the current one, with the stored
    /// body its value carries: `body` (sealed) when the change brings one, else the one the
    /// current version carries on. Returns the current version too.
    fn change<E: Into<StoreError>>(
        &mut self,
        pending: &mut Pending,
        id: &str,
        body: Option<&Bytes>,
        next: impl FnOnce(Option<Record>) -> Result<Record, E>,
    ) -> Result<Staging, StoreError> {
        let old = self.read(pending, id)?;
        let new = next(old.clone().map(Arc::unwrap_or_clone)).map_err(Into::into)?;
        let stored = match body {
            Some(b) => Some(Bytes::from(seal_opt(self.sealer.as_deref(), b))),
            None => self.kept_body(pending, old.as_deref(), &new)?,
        };
        Ok(Staging { old, new, stored })
    }

    /// Stages a change made by [`Writer::change`] in the batch, with its body and its log entry.
    fn commit(
        &mut self,
        pending: &mut Pending,
        change: Staging,
        body: Option<Bytes>,
        event: impl FnOnce(&Record) -> RecordEvent<'_>,
    ) -> Arc<Record> {
        let Staging { old, new, stored } = change;
        if let Some(body) = body {
            pending.bodies.insert(new.id.clone(), body);
        }
        let new = self.stage(pending, old.as_deref(), Arc::new(new), stored);
        self.append_record(pending, &event(&new));
        new
    }
}

/// A record's next version, before it is staged: the version it replaces and the stored body
/// its value carries.
struct Staging {
    old: Option<Arc<Record>>,
    new: Record,
    stored: Option<Bytes>,
}
