//! What the store's callers send the writer thread, and how they are answered.

use super::*;

pub(super) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

pub(super) enum Op {
    Claim(Box<ClaimRequest>, Reply<Claim>),
    Settle(Box<SettleRequest>, Reply<Arc<Record>>),
    Resolve(String, Box<Resolve>, Event, Reply<Arc<Record>>),
    /// Notes are waiting in the shared buffer.
    Notes,
    Recover(Option<String>, Millis, Reply<usize>),
    /// Expires what is due from the expiry index, at most [`EXPIRE_STEP`] entries after the
    /// cursor (`None`: the start); answers the count and where the next step starts.
    Expire(Millis, Option<Vec<u8>>, Reply<(usize, Option<Vec<u8>>)>),
    Sync(Reply<()>),
    Renew(String, String, Millis, Reply<bool>),
}

impl Op {
    /// Whether its batch needs an fdatasync before answering: everything but notes and lease
    /// renewals, which become durable within [`LAZY_FLUSH`].
    pub(super) fn needs_flush(&self) -> bool {
        !matches!(self, Op::Notes | Op::Renew(..))
    }
}

/// An answer decided in a batch, sent once the batch is durable.
pub(super) enum Answer {
    Claim(Reply<Claim>, Box<Claim>),
    /// The record as the batch holds it, shared with the caller once it is durable.
    Record(Reply<Arc<Record>>, Arc<Record>),
    Count(Reply<usize>, usize),
    Step(Reply<(usize, Option<Vec<u8>>)>, usize, Option<Vec<u8>>),
    Unit(Reply<()>),
    Bool(Reply<bool>, bool),
    /// The operation failed on its own; the closure sends its error.
    Failed(Box<dyn FnOnce() + Send>),
    None,
}

impl Answer {
    pub(super) fn failed<T: Send + 'static>(tx: Reply<T>, e: StoreError) -> Answer {
        Answer::Failed(Box::new(move || drop(tx.send(Err(e)))))
    }

    pub(super) fn send(self, commit: &Result<(), String>) {
        // A batch that could not be made durable broke the store (`Shared::fail`) until restart.
        let err = |e: &String| StoreError::Broken(e.clone());
        match (self, commit) {
            (Answer::Failed(f), _) => f(),
            (Answer::None, _) => {}
            (Answer::Claim(tx, c), Ok(())) => drop(tx.send(Ok(*c))),
            (Answer::Record(tx, r), Ok(())) => drop(tx.send(Ok(r))),
            (Answer::Count(tx, n), Ok(())) => drop(tx.send(Ok(n))),
            (Answer::Step(tx, n, next), Ok(())) => drop(tx.send(Ok((n, next)))),
            (Answer::Unit(tx), Ok(())) => drop(tx.send(Ok(()))),
            (Answer::Bool(tx, b), Ok(())) => drop(tx.send(Ok(b))),
            (Answer::Bool(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Claim(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Record(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Count(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Step(tx, ..), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Unit(tx), Err(e)) => drop(tx.send(Err(err(e)))),
        }
    }
}
