//! The operations the writer gathers into a batch (SPEC §13): what a request waits for, and what
//! each came to.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::{unavailable, Moves};
use crate::action::{Claim, ClaimRequest, Millis, Record, Resolve};
use crate::log::{Event, LogEvent};
use crate::store::{SettleRequest, StoreError};

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// One change a request waits for.
pub(super) enum Op {
    Claim(Box<ClaimRequest>, Reply<Claim>),
    Settle(Box<SettleRequest>, Reply<Arc<Record>>),
    Resolve(String, Box<Resolve>, Event, Reply<Record>),
    /// An audit entry for an event that changes no record (a replay, a refusal): written with
    /// the batch's log, answered to nobody.
    Note(Box<LogEvent>),
}

impl Op {
    pub(super) fn id(&self) -> &str {
        match self {
            Op::Claim(r, _) => &r.fresh.id,
            Op::Settle(r, _) => &r.id,
            Op::Resolve(id, ..) => id,
            Op::Note(..) => "",
        }
    }

    pub(super) fn twin_key(&self) -> Option<&str> {
        match self {
            Op::Claim(r, _) => r.twin_key(),
            _ => None,
        }
    }

    /// The caller's time, which a store opened with `caller_clock` judges by.
    pub(super) fn given(&self) -> Millis {
        match self {
            Op::Claim(r, _) => r.now,
            Op::Settle(r, _) => r.settlement.now,
            Op::Resolve(_, r, ..) => r.now,
            Op::Note(..) => 0,
        }
    }

    pub(super) fn answer(self, done: Result<Done, StoreError>) {
        match (self, done) {
            (Op::Claim(_, tx), Ok(Done::Claim(c))) => drop(tx.send(Ok(c))),
            (Op::Settle(_, tx), Ok(Done::Settle(r))) => drop(tx.send(Ok(r))),
            (Op::Resolve(.., tx), Ok(Done::Resolve(r))) => drop(tx.send(Ok(*r))),
            (Op::Claim(_, tx), Err(e)) => drop(tx.send(Err(e))),
            (Op::Settle(_, tx), Err(e)) => drop(tx.send(Err(e))),
            (Op::Resolve(.., tx), Err(e)) => drop(tx.send(Err(e))),
            (Op::Note(..), Ok(_)) => {}
            (Op::Note(..), Err(e)) => {
                tracing::warn!(error = %e, "could not append a write-log entry")
            }
            (op, Ok(_)) => {
                let e = unavailable("internal error: an answer of another kind");
                op.answer(Err(e))
            }
        }
    }
}

/// What an operation came to.
pub(super) enum Done {
    Claim(Claim),
    Settle(Arc<Record>),
    Resolve(Box<Record>),
    Note,
}

/// What one operation changes besides its record: its log entries and the counts' moves.
pub(super) type Changes = (Vec<LogEvent>, Moves);
