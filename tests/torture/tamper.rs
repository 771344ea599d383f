//! Faults between a kill and the next start (issue 58): the store's folder tampered with as an
//! operator's mistake or a bad restore would, then a start. A store that is not whole must be
//! refused (exit 74); put right, it starts and carries on, and the run's ledger shows that no
//! write was sent twice meanwhile.
//!
//! - *A stale copy*: sled's files as a clean stop left them earlier in the run, put back in
//!   place of the current ones. Refused when the write-ahead log no longer reaches back to the
//!   copy; when it still does (no checkpoint since), the copy and the log make the whole store,
//!   it opens, and the run carries on from it.
//! - *A partial folder*: `store.id` gone. Always refused.

use std::path::Path;
use std::time::{Duration, Instant};

/// What a start on a tampered store did.
pub(crate) enum Start {
    /// It exited 74, with this message.
    Refused(String),
    /// It opened (and was killed again at once).
    Opened,
    /// Anything else: its exit code and message.
    Other(Option<i32>, String),
}

/// Keeps a copy of sled's files in `store` (taken after a clean stop) at `copy`.
pub(crate) fn keep_copy(store: &Path, copy: &Path) {
    crate::support::place_sled_files(store, copy, true);
}

/// Starts the proxy on `cfg` and reports how the start ended.
pub(crate) fn start(cfg: &Path) -> Start {
    let err = cfg.with_extension("stderr");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"))
        .args(["run", "--config"])
        .arg(cfg)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let msg = std::fs::read_to_string(&err).unwrap_or_default();
            return match status.code() {
                Some(74) => Start::Refused(msg),
                code => Start::Other(code, msg),
            };
        }
        let msg = std::fs::read_to_string(&err).unwrap_or_default();
        if msg.contains("addr=") || Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            return Start::Opened;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The stale copy put back: the start's result. A refused store gets its current files back;
/// one that opened carries on from the copy.
pub(crate) fn stale_copy(cfg: &Path, store: &Path, copy: &Path) -> Start {
    let aside = store.with_extension("aside");
    crate::support::place_sled_files(store, &aside, false);
    crate::support::place_sled_files(copy, store, true);
    let started = start(cfg);
    if matches!(started, Start::Refused(_)) {
        crate::support::place_sled_files(&aside, store, false);
    }
    let _ = std::fs::remove_dir_all(&aside);
    started
}

/// `store.id` removed: the start's result; the file is put back after.
pub(crate) fn partial_folder(cfg: &Path, store: &Path) -> Start {
    let (id, aside) = (store.join("store.id"), store.join("store.id.aside"));
    std::fs::rename(&id, &aside).unwrap();
    let started = start(cfg);
    std::fs::rename(&aside, &id).unwrap();
    started
}
