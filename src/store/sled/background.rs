//! Threads that keep the store but answer no request give way to those that do.
//!
//! The drainer (sled applied behind the write-ahead log), the checkpoint (sled made durable, log
//! files let go) and the helper that makes the filter of held ids anew are housekeeping: a
//! request never waits for them unless they fall far behind (then the syncer paces writes to
//! the drainer: [`super::syncer`]). On a machine whose cores are busy, the kernel still shares a
//! core between them and the threads that answer requests (tokio's workers, the writer, the
//! syncer) equally, and a request woken behind the drainer's slice waits it out. A lower
//! priority (a higher nice value, per thread on Linux) makes the kernel run the request path
//! first and housekeeping in the time left; with cores to spare, nothing changes. RocksDB lowers
//! its compaction threads' CPU priority for the same reason.

/// How much nicer than the process a housekeeping thread is: at nice 10 against 0, the kernel
/// gives it about a tenth of a contended core's time (each nice step is about 1.25×).
const NICER: i32 = 10;

/// Lowers the calling thread's CPU priority by [`NICER`] (at most to 19). Where the system does
/// not allow it (a sandbox that filters the call), the thread keeps its priority and the proxy
/// says so at debug level: it changes how the store shares a busy machine, never what it does.
pub(super) fn give_way(thread: &str) {
    use rustix::process::{getpriority_process, setpriority_process};
    let tid = rustix::thread::gettid();
    let lowered = getpriority_process(Some(tid))
        .and_then(|nice| setpriority_process(Some(tid), (nice + NICER).min(19)));
    if let Err(e) = lowered {
        tracing::debug!(thread, error = %e, "store: a housekeeping thread keeps its priority");
    }
}
