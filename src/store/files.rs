//! File-system steps the sled store's own files share: the write-ahead log ([`super::wal`]) and
//! the write log ([`super::logfiles`]) are both folders of numbered, append-only files.

use std::fs::{File, OpenOptions};
use std::io::{self, Read as _};
use std::path::Path;

/// Makes a folder's entries (files created, renamed or removed in it) durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` if missing; a new folder's own entry is made durable too.
pub fn create_dir(dir: &Path) -> Result<(), String> {
    let existed = dir.exists();
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    if !existed {
        if let Some(parent) = dir.parent() {
            fsync_dir(parent).map_err(|e| format!("fsync {}: {e}", parent.display()))?;
        }
    }
    Ok(())
}

/// The numbers of the files in `dir` named `{number}.{ext}`, ascending.
pub fn numbered(dir: &Path, ext: &str) -> Result<Vec<u64>, String> {
    let list = || -> io::Result<Vec<u64>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir)? {
            let name = e?.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = name
                .strip_suffix(ext)
                .and_then(|n| n.strip_suffix('.'))
                .and_then(|n| n.parse().ok())
            {
                out.push(n);
            }
        }
        out.sort_unstable();
        Ok(out)
    };
    list().map_err(|e| format!("list {}: {e}", dir.display()))
}

/// A whole file.
pub fn read(path: &Path) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    Ok(bytes)
}

/// Cuts a file to its first `len` bytes, durably: the torn tail a crash left in the newest file.
pub fn cut(path: &Path, len: u64) -> Result<(), String> {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    f.set_len(len)
        .and_then(|()| f.sync_all())
        .map_err(|e| format!("cut {}: {e}", path.display()))
}
