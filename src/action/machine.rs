//! The action's state machine (SPEC §4.1, §5, §9): the pure transitions every store applies
//! inside its atomic step: claim (with the unsettled-twin guard and `fingerprint_window`),
//! settle, resolve and recover.

use std::sync::Arc;

use super::{
    KeySource, Millis, Phase, Record, Resolution, State, StoredResponse, Try, RECORD_VERSION,
};

/// A request to settle an `unknown` action (SPEC §9).
#[derive(Debug, Clone, PartialEq)]
pub struct Resolve {
    pub applied: bool,
    pub external_id: Option<String>,
    /// The lookup's answer, kept for replays (`applied` by lookup only), and its body.
    pub response: Option<StoredResponse>,
    pub body: Option<bytes::Bytes>,
    pub actor: String,
    pub reason: String,
    pub now: Millis,
    /// A lookup that found nothing settles `not applied` only when the last send is at least
    /// this old (SPEC §9 `absent_after`): a lagging index or a slow upstream may still show it.
    /// Judged here, inside the store's atomic step and with the store's clock.
    pub absent_after: Option<Millis>,
}

/// Why a resolution was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("action {0} not found")]
    NotFound(String),
    #[error("action {id} is {state}, not unknown")]
    NotUnknown { id: String, state: &'static str },
    /// Not found yet, but the last send is younger than `absent_after`: it stays unknown.
    #[error("action {id} was last sent {age_ms} ms ago, less than absent_after ({absent_after_ms} ms): not found yet is not proof that it was not applied")]
    TooEarly {
        id: String,
        age_ms: Millis,
        absent_after_ms: Millis,
    },
}

/// Settles an `unknown` action as applied (`succeeded`) or not applied (`failed`, so that the next
/// request sends a new attempt with the same key).
pub fn apply_resolve(
    current: Option<Record>,
    id: &str,
    res: Resolve,
) -> Result<Record, ResolveError> {
    let mut r = current.ok_or_else(|| ResolveError::NotFound(id.to_string()))?;
    if r.state != State::Unknown {
        return Err(ResolveError::NotUnknown {
            id: id.to_string(),
            state: r.state.as_str(),
        });
    }
    if let (false, Some(wait)) = (res.applied, res.absent_after) {
        let age = res.now.saturating_sub(r.last_sent().unwrap_or(0));
        if age < wait {
            return Err(ResolveError::TooEarly {
                id: id.to_string(),
                age_ms: age,
                absent_after_ms: wait,
            });
        }
    }
    if let Some(a) = r.evidence.last_mut() {
        a.ended_at.get_or_insert(res.now);
    }
    r.state = if res.applied {
        State::Succeeded
    } else {
        State::Failed
    };
    r.owner = None;
    r.lease_until = None;
    r.needs_decision = false;
    if res.applied {
        if res.external_id.is_some() {
            r.external_id = res.external_id;
        }
        r.response = res.response;
    }
    r.resolution = Some(Resolution {
        at: res.now,
        actor: res.actor,
        applied: res.applied,
        reason: res.reason,
    });
    r.touch(res.now);
    Ok(r)
}

/// The unsettled-twin guard of a claim (SPEC §4.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwinGuard {
    /// [`crate::identity::twin_key`] of the write: what its twins share.
    pub key: String,
    /// The unsettled action this write knowingly repeats (`Oncegate-Allow-Twin`).
    pub allow: Option<String>,
}

/// A request to claim an action for a new attempt (SPEC §5 step 2).
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The record to create when none exists (state and attempt fields are set by the claim).
    pub fresh: Record,
    pub key_source: KeySource,
    pub max_attempts: u32,
    pub owner: String,
    pub lease: Millis,
    pub now: Millis,
    /// The unsettled-twin guard, when on for this write.
    pub twin: Option<TwinGuard>,
    /// `fingerprint_window`, for a fingerprint key: how long after it settled an identical
    /// keyless write is still this action (SPEC §4.1 rule 3). `None`: the retention.
    pub window: Option<Millis>,
}

impl ClaimRequest {
    /// Whether this request reuses the key of `existing` for a different request (422
    /// `key-reused`). Under a task-step key a different body is the same action (SPEC §4.1).
    pub fn reuses_key(&self, existing: &Record) -> bool {
        self.key_source != KeySource::TaskStep && existing.fingerprint != self.fresh.fingerprint
    }

    /// Whether `existing` gives way to a new action under its key: its retention passed, or,
    /// under a fingerprint key, its `fingerprint_window` since it settled.
    pub fn replaces(&self, existing: &Record) -> bool {
        let window = self
            .window
            .filter(|_| self.key_source == KeySource::Fingerprint);
        existing.outlived(self.now, window)
    }

    /// The guard's key, when the guard is on for this request.
    pub fn twin_key(&self) -> Option<&str> {
        self.twin.as_ref().map(|t| t.key.as_str())
    }
}

/// What a claim found. The record is shared: a store that keeps it (the embedded store's batch,
/// its cache) answers with the same one, not a copy.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// This caller owns a new attempt; the record is durable and `in_flight`.
    Claimed(Arc<Record>),
    /// The action exists and is not claimable now (`succeeded`, `in_flight`, `unknown`).
    Existing(Arc<Record>),
    /// Same key, different fingerprint.
    KeyReused(Arc<Record>),
    /// `failed` with no attempts left.
    Exhausted(Arc<Record>),
    /// Not sent: an identical write under another key is unsettled (this is that action).
    Twin(Arc<Record>),
}

impl Claim {
    /// The record the claim found or wrote.
    pub fn record(&self) -> &Arc<Record> {
        match self {
            Claim::Claimed(r)
            | Claim::Existing(r)
            | Claim::KeyReused(r)
            | Claim::Exhausted(r)
            | Claim::Twin(r) => r,
        }
    }

    /// The same answer with `r` (the record as the store wrote it).
    pub fn with_record(self, r: Arc<Record>) -> Claim {
        match self {
            Claim::Claimed(_) => Claim::Claimed(r),
            Claim::Existing(_) => Claim::Existing(r),
            Claim::KeyReused(_) => Claim::KeyReused(r),
            Claim::Exhausted(_) => Claim::Exhausted(r),
            Claim::Twin(_) => Claim::Twin(r),
        }
    }
}

/// Decides a claim against the current record and, when the guard is on, the action holding
/// the write's twin slot (`twin`: [`TwinGuard::key`]'s holder, if any). Returns the answer and
/// the record to write, if any. Every backend calls this (or [`decide_claim_owned`]) inside its
/// atomic section.
pub fn decide_claim(
    current: Option<Record>,
    twin: Option<Arc<Record>>,
    req: &ClaimRequest,
) -> (Claim, Option<Record>) {
    let (claim, write) = match current.filter(|r| !req.replaces(r)) {
        None => claim_new(req.fresh.clone(), twin, req),
        Some(r) => claim_existing(r, twin, req),
    };
    let write = write.then(|| Record::clone(claim.record()));
    (claim, write)
}

/// [`decide_claim`] for a caller that owns the request: a new action's record is the request's
/// own fresh record, moved rather than copied, and the record to write is the claim's own
/// (`true`: [`Claim::record`] is to be written), shared rather than copied.
pub fn decide_claim_owned(
    current: Option<Record>,
    twin: Option<Arc<Record>>,
    mut req: ClaimRequest,
) -> (Claim, bool) {
    match current.filter(|r| !req.replaces(r)) {
        None => {
            let fresh = std::mem::replace(&mut req.fresh, Record::new("", ""));
            claim_new(fresh, twin, &req)
        }
        Some(r) => claim_existing(r, twin, &req),
    }
}

/// What the unsettled-twin guard says of a claim that would send (SPEC §4.1), given the holder
/// of its twin slot: `Err` with the unsettled twin that stops it, or whether its attempt takes
/// the slot (`false` where the guard is off, and for a declared twin of a live holder, which
/// keeps it).
fn twin_slot(twin: Option<Arc<Record>>, req: &ClaimRequest) -> Result<bool, Arc<Record>> {
    let Some(guard) = &req.twin else {
        return Ok(false);
    };
    match twin.filter(|t| t.id != req.fresh.id && t.holds_twin()) {
        None => Ok(true),
        Some(t) if guard.allow.as_deref() == Some(t.id.as_str()) => Ok(false),
        Some(t) => Err(t),
    }
}

/// A new action (or one whose record expired): its first attempt, claimed, unless an
/// unsettled twin stops it.
fn claim_new(mut r: Record, twin: Option<Arc<Record>>, req: &ClaimRequest) -> (Claim, bool) {
    let slot = match twin_slot(twin, req) {
        Ok(slot) => slot,
        Err(t) => return (Claim::Twin(t), false),
    };
    r.v = RECORD_VERSION;
    r.attempts = 0;
    r.evidence.clear();
    r.response = None;
    r.resolution = None;
    r.external_id = None;
    r.created_at = req.now;
    r.twin = slot;
    r.start_attempt(&req.owner, req.lease, req.now);
    (Claim::Claimed(Arc::new(r)), true)
}

/// An action that exists and has not expired.
fn claim_existing(r: Record, twin: Option<Arc<Record>>, req: &ClaimRequest) -> (Claim, bool) {
    match r {
        r if req.reuses_key(&r) => (Claim::KeyReused(Arc::new(r)), false),
        r if r.state == State::Failed && r.attempts >= req.max_attempts => {
            (Claim::Exhausted(Arc::new(r)), false)
        }
        mut r if r.state == State::Failed => {
            // A new attempt is a send like a first one: an unsettled twin stops it too.
            r.twin = match twin_slot(twin, req) {
                Ok(slot) => slot,
                Err(t) => return (Claim::Twin(t), false),
            };
            r.start_attempt(&req.owner, req.lease, req.now);
            (Claim::Claimed(Arc::new(r)), true)
        }
        // An attempt whose owner stopped renewing its lease (a proxy that died): its outcome
        // is unknown, whoever notices first records it.
        r if r.state == State::InFlight && r.lease_until.is_some_and(|l| l < req.now) => {
            let reason = format!(
                "the lease of proxy {} expired during this attempt; the request may have reached the upstream",
                r.owner.as_deref().unwrap_or("?")
            );
            let u = recover_in_flight(r, &reason, req.now).expect("the record is in flight");
            (Claim::Existing(Arc::new(u)), true)
        }
        r => (Claim::Existing(Arc::new(r)), false),
    }
}

/// How an attempt ended (SPEC §5 step 5).
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    pub state: State,
    pub tries: Vec<Try>,
    pub response: Option<StoredResponse>,
    pub external_id: Option<String>,
    pub needs_decision: bool,
    pub now: Millis,
}

impl Settlement {
    /// One try at `now` that the upstream answered with `response` (its status the try's), and
    /// the action succeeded: the settlement the store's tests and benches write.
    pub fn succeeded(now: Millis, response: StoredResponse) -> Settlement {
        Settlement {
            state: State::Succeeded,
            tries: vec![Try {
                at: now,
                status: Some(response.status),
                ..Default::default()
            }],
            response: Some(response),
            external_id: None,
            needs_decision: false,
            now,
        }
    }
}

/// Why a settlement was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    #[error("action {0} not found")]
    NotFound(String),
    /// The attempt is no longer the current one (e.g. its lease expired and it was marked
    /// unknown by another proxy, then settled again).
    #[error("attempt {attempt} of action {id} is not in flight")]
    Stale { id: String, attempt: u32 },
}

/// Applies the outcome of attempt `attempt`. An attempt whose record was turned `unknown` (its
/// proxy was presumed dead) may still report: a real answer is better evidence than none.
pub fn apply_settle(
    current: Option<Record>,
    id: &str,
    attempt: u32,
    s: Settlement,
) -> Result<Record, SettleError> {
    let mut r = current.ok_or_else(|| SettleError::NotFound(id.to_string()))?;
    let live = r.state == State::InFlight
        || (r.state == State::Unknown && r.evidence.last().is_some_and(|a| a.ended_at.is_none()));
    if r.attempts != attempt || !live {
        return Err(SettleError::Stale {
            id: id.to_string(),
            attempt,
        });
    }
    r.end_attempt(s.state, s.tries, s.now);
    r.needs_decision = s.needs_decision;
    if s.response.is_some() {
        r.response = s.response;
    }
    if s.external_id.is_some() {
        r.external_id = s.external_id;
    }
    Ok(r)
}

/// Turns an `in_flight` record whose proxy stopped (or whose lease expired) into `unknown`: it
/// cannot be known whether the request left. Returns `None` when there is nothing to do.
pub fn recover_in_flight(mut r: Record, reason: &str, now: Millis) -> Option<Record> {
    if r.state != State::InFlight {
        return None;
    }
    if let Some(a) = r.evidence.last_mut() {
        a.tries.push(Try {
            at: now,
            phase: Some(Phase::Send),
            error: Some(reason.to_string()),
            ..Try::default()
        });
        a.state = Some(State::Unknown);
    }
    r.state = State::Unknown;
    r.owner = None;
    r.lease_until = None;
    r.touch(now);
    Some(r)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn fresh(fp: &str) -> Record {
        Record {
            upstream: "u".into(),
            principal: "anonymous".into(),
            key: "k".into(),
            method: "POST".into(),
            path: "/c".into(),
            retention_ms: 1000,
            ..Record::new("id1", fp)
        }
    }

    fn req(fp: &str, now: Millis) -> ClaimRequest {
        ClaimRequest {
            fresh: fresh(fp),
            key_source: KeySource::Header,
            max_attempts: 2,
            owner: "me".into(),
            lease: 100,
            now,
            twin: None,
            window: None,
        }
    }

    fn decide_claim_t(current: Option<Record>, req: &ClaimRequest) -> (Claim, Option<Record>) {
        decide_claim(current, None, req)
    }

    fn settle(state: State, now: Millis) -> Settlement {
        Settlement {
            state,
            tries: vec![],
            response: None,
            external_id: None,
            needs_decision: false,
            now,
        }
    }

    #[test]
    fn every_state_is_listed_once_in_declaration_order() {
        for (i, st) in State::ALL.into_iter().enumerate() {
            assert_eq!(st as usize, i);
            assert_eq!(State::parse(st.as_str()), Some(st));
        }
    }

    #[test]
    fn claim_lifecycle() {
        let (c, w) = decide_claim_t(None, &req("f", 10));
        let Claim::Claimed(r) = c else {
            panic!("new action is claimed")
        };
        assert_eq!(
            (r.state, r.attempts, r.expires_at),
            (State::InFlight, 1, None)
        );
        let w = w.expect("a claim writes");
        // In flight: a duplicate sees it and writes nothing.
        let (c, w2) = decide_claim_t(Some(w.clone()), &req("f", 11));
        assert!(matches!(c, Claim::Existing(_)) && w2.is_none());
        // Different fingerprint: key reused, whatever the state.
        assert!(matches!(
            decide_claim_t(Some(w.clone()), &req("g", 11)).0,
            Claim::KeyReused(_)
        ));
        // Failed with attempts left: attempt 2.
        let failed = apply_settle(Some(w), "id1", 1, settle(State::Failed, 12)).expect("settles");
        let (c, w) = decide_claim_t(Some(failed), &req("f", 13));
        assert!(matches!(c, Claim::Claimed(ref r) if r.attempts == 2));
        let failed = apply_settle(w, "id1", 2, settle(State::Failed, 14)).expect("settles");
        // No attempts left.
        assert!(matches!(
            decide_claim_t(Some(failed.clone()), &req("f", 15)).0,
            Claim::Exhausted(_)
        ));
        // Expired: a new action, attempt 1.
        let (c, _) = decide_claim_t(Some(failed), &req("f", 14 + 1000));
        assert!(matches!(c, Claim::Claimed(ref r) if r.attempts == 1 && r.evidence.len() == 1));
    }

    #[test]
    fn the_owned_claim_decides_as_the_borrowed_one() {
        let (_, w) = decide_claim_t(None, &req("f", 10));
        let running = w.expect("a claim writes");
        let failed = apply_settle(Some(running.clone()), "id1", 1, settle(State::Failed, 12))
            .expect("settles");
        let (_, w) = decide_claim_t(Some(failed.clone()), &req("f", 13));
        let exhausted = apply_settle(w, "id1", 2, settle(State::Failed, 14)).expect("settles");
        let mut lease_gone = running.clone();
        lease_gone.lease_until = Some(11);
        let cases = [
            (None, req("f", 10)),
            (Some(running.clone()), req("f", 11)),
            (Some(running), req("g", 11)),
            (Some(lease_gone), req("f", 500)),
            (Some(failed.clone()), req("f", 13)),
            (Some(exhausted.clone()), req("f", 15)),
            (Some(exhausted), req("f", 14 + 1000)),
            (Some(failed), req("g", 14 + 1000)),
        ];
        for (current, req) in cases {
            let (claim, write) = decide_claim_t(current.clone(), &req);
            let (owned, writes) = decide_claim_owned(current, None, req);
            assert_eq!(owned, claim);
            assert_eq!(writes.then(|| Record::clone(owned.record())), write);
        }
    }

    #[test]
    fn unsettled_actions_never_expire_and_retention_counts_from_the_settlement() {
        // Retention 1000 ms. An attempt still running long after it: a duplicate waits on it.
        let (_, w) = decide_claim_t(None, &req("f", 10));
        let running = w.expect("claim writes");
        let mut long = req("f", 10 + 5_000);
        long.lease = 100_000;
        let (c, w) = decide_claim_t(Some(running.clone()), &req("f", 10 + 50));
        assert!(matches!(c, Claim::Existing(_)) && w.is_none());
        let mut live = running.clone();
        live.lease_until = Some(1_000_000);
        let (c, w) = decide_claim_t(Some(live), &long);
        assert!(
            matches!(c, Claim::Existing(ref r) if r.state == State::InFlight) && w.is_none(),
            "an attempt running past retention is not claimed again: {c:?}"
        );
        // Unknown, an hour later: still unknown, never a new action.
        let unknown =
            apply_settle(Some(running), "id1", 1, settle(State::Unknown, 20)).expect("settles");
        assert_eq!(unknown.expires_at, None);
        let (c, w) = decide_claim_t(Some(unknown.clone()), &req("f", 3_600_000));
        assert!(
            matches!(c, Claim::Existing(ref r) if r.state == State::Unknown) && w.is_none(),
            "{c:?}"
        );
        // A record written by an older version with an expiry in the past: still unknown.
        let old = Record {
            expires_at: Some(5),
            ..unknown
        };
        assert!(!old.is_expired(3_600_000));
        // Settled at 3_600_000: it expires 1000 ms later, not 1000 ms after its creation.
        let done = apply_resolve(
            Some(old),
            "id1",
            Resolve {
                applied: true,
                external_id: None,
                response: None,
                body: None,
                actor: "admin".into(),
                reason: "checked".into(),
                now: 3_600_000,
                absent_after: None,
            },
        )
        .expect("resolves");
        assert_eq!(done.expires_at, Some(3_601_000));
        assert!(!done.is_expired(3_600_999) && done.is_expired(3_601_000));
    }

    #[test]
    fn a_task_step_key_is_one_action_whatever_the_body() {
        let (_, w) = decide_claim_t(None, &req("f", 10));
        let done = apply_settle(w, "id1", 1, settle(State::Succeeded, 11)).expect("settles");
        let mut regenerated = req("a regenerated body", 12);
        regenerated.key_source = KeySource::TaskStep;
        assert!(
            matches!(decide_claim_t(Some(done.clone()), &regenerated).0, Claim::Existing(ref r) if r.state == State::Succeeded)
        );
        // The same under a client's key is a reuse.
        regenerated.key_source = KeySource::Header;
        assert!(matches!(
            decide_claim_t(Some(done), &regenerated).0,
            Claim::KeyReused(_)
        ));
    }

    #[test]
    fn not_found_settles_not_applied_only_after_absent_after() {
        let (_, w) = decide_claim_t(None, &req("f", 10));
        let unknown = apply_settle(w, "id1", 1, settle(State::Unknown, 2_000)).expect("settles");
        assert_eq!(unknown.last_sent(), Some(2_000));
        let absent = |now| Resolve {
            applied: false,
            external_id: None,
            response: None,
            body: None,
            actor: "lookup".into(),
            reason: "404".into(),
            now,
            absent_after: Some(10_000),
        };
        assert!(matches!(
            apply_resolve(Some(unknown.clone()), "id1", absent(2_300)),
            Err(ResolveError::TooEarly { .. })
        ));
        let failed = apply_resolve(Some(unknown), "id1", absent(12_000)).expect("old enough");
        assert_eq!(failed.state, State::Failed);
    }

    #[test]
    fn settle_refuses_stale_attempts_and_recover_marks_unknown() {
        let (_, w) = decide_claim_t(None, &req("f", 10));
        let w = w.expect("claim writes");
        assert!(matches!(
            apply_settle(Some(w.clone()), "id1", 2, settle(State::Succeeded, 11)),
            Err(SettleError::Stale { .. })
        ));
        let u = recover_in_flight(w.clone(), "proxy stopped", 12).expect("in flight recovers");
        assert_eq!(u.state, State::Unknown);
        assert_eq!(
            u.evidence[0].tries[0].error.as_deref(),
            Some("proxy stopped")
        );
        assert!(recover_in_flight(u, "again", 13).is_none());
        let done = apply_settle(Some(w), "id1", 1, settle(State::Succeeded, 11)).expect("ok");
        assert!(matches!(
            apply_settle(Some(done), "id1", 1, settle(State::Failed, 12)),
            Err(SettleError::Stale { .. })
        ));
    }

    fn guarded(fp: &str, id: &str, now: Millis, allow: Option<&str>) -> ClaimRequest {
        let mut r = req(fp, now);
        r.fresh.id = id.into();
        r.twin = Some(TwinGuard {
            key: "tw-1".into(),
            allow: allow.map(str::to_string),
        });
        r
    }

    #[test]
    fn an_unsettled_twin_stops_a_new_key_until_it_settles() {
        let (_, w) = decide_claim_t(None, &guarded("f", "a", 10, None));
        let first = w.expect("claims");
        assert!(first.twin && first.holds_twin());
        let holder = Some(Arc::new(first.clone()));
        // Another key, same write: not sent, the answer names the first.
        let (c, w) = decide_claim(None, holder.clone(), &guarded("f", "b", 11, None));
        assert!(
            matches!(c, Claim::Twin(ref t) if t.id == "a") && w.is_none(),
            "{c:?}"
        );
        // A failed action's new attempt is stopped the same way.
        let mut failed = fresh("f");
        failed.id = "c".into();
        failed.state = State::Failed;
        failed.attempts = 1;
        let (c, _) = decide_claim(Some(failed), holder.clone(), &guarded("f", "c", 11, None));
        assert!(matches!(c, Claim::Twin(_)), "{c:?}");
        // Declared: sent, and the first keeps the slot.
        let (c, w) = decide_claim(None, holder.clone(), &guarded("f", "b", 11, Some("a")));
        assert!(matches!(c, Claim::Claimed(_)));
        assert!(!w.expect("claims").twin);
        // Naming another action declares nothing.
        let (c, _) = decide_claim(None, holder.clone(), &guarded("f", "b", 11, Some("zz")));
        assert!(matches!(c, Claim::Twin(_)));
        // Unknown stops it too; settled does not.
        let unknown =
            apply_settle(Some(first.clone()), "a", 1, settle(State::Unknown, 12)).expect("settles");
        assert!(unknown.holds_twin());
        let (c, _) = decide_claim(None, Some(Arc::new(unknown)), &guarded("f", "b", 13, None));
        assert!(matches!(c, Claim::Twin(_)));
        let done =
            apply_settle(Some(first), "a", 1, settle(State::Succeeded, 12)).expect("settles");
        assert!(!done.holds_twin());
        let (c, w) = decide_claim(None, Some(Arc::new(done)), &guarded("f", "b", 13, None));
        assert!(matches!(c, Claim::Claimed(_)) && w.expect("claims").twin);
        // With the guard off, nothing is checked and no slot taken.
        let (c, w) = decide_claim(None, holder, &req("f", 11));
        assert!(matches!(c, Claim::Claimed(_)) && !w.expect("claims").twin);
    }

    #[test]
    fn a_fingerprint_key_is_a_new_action_after_its_window() {
        let mut r = req("f", 10);
        r.key_source = KeySource::Fingerprint;
        r.window = Some(100);
        let (_, w) = decide_claim_t(None, &r);
        let done = apply_settle(w, "id1", 1, settle(State::Succeeded, 20)).expect("settles");
        assert_eq!(done.settled_at(), Some(20));
        r.now = 119;
        assert!(matches!(
            decide_claim_t(Some(done.clone()), &r).0,
            Claim::Existing(_)
        ));
        r.now = 120;
        let (c, _) = decide_claim_t(Some(done.clone()), &r);
        assert!(matches!(c, Claim::Claimed(ref n) if n.attempts == 1 && n.created_at == 120));
        // A client's key is not bound by the window: the retention decides.
        r.key_source = KeySource::Header;
        assert!(matches!(
            decide_claim_t(Some(done), &r).0,
            Claim::Existing(_)
        ));
    }
}
