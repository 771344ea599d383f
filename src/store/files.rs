//! File-system steps the sled store's own files share: the write-ahead log ([`super::wal`]) and
//! the write log ([`super::logfiles`]) are both folders of numbered, append-only files.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Folders of the store: only its owner may list or enter them (SPEC §13).
pub const DIR_MODE: u32 = 0o700;
/// Files of the store: only its owner may read them; they hold response bodies and headers.
pub const FILE_MODE: u32 = 0o600;

/// Options that create a file readable by its owner only.
pub fn private() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(FILE_MODE);
    o
}

/// Creates (or truncates) a file readable by its owner only.
pub fn create_private(path: &Path) -> io::Result<File> {
    private().write(true).create(true).truncate(true).open(path)
}

/// Creates `dir` and its missing parents, each `0700`.
pub fn create_private_dir_all(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
}

/// Narrows what the store's folder already holds to the owner: files `0600`, folders `0700`,
/// recursively (sled creates its own files with the process's umask; a store from an older
/// version had 0644/0755).
pub fn restrict(dir: &Path) -> io::Result<()> {
    let set = |p: &Path, mode: u32| -> io::Result<()> {
        let meta = std::fs::symlink_metadata(p)?;
        if meta.permissions().mode() & 0o777 != mode {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))?;
        }
        Ok(())
    };
    set(dir, DIR_MODE)?;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let kind = e.file_type()?;
        if kind.is_dir() {
            restrict(&e.path())?;
        } else if kind.is_file() {
            set(&e.path(), FILE_MODE)?;
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` whole or not at all, across a crash too: into `tmp` (readable by its
/// owner only, in the same folder), fsynced, renamed over `path`, then the folder fsynced.
pub fn write_whole(tmp: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_whole_with(tmp, path, |f| f.write_all(bytes))
}

/// [`write_whole`] of what `write` writes, through a buffer: a file too large to be made in
/// memory first.
pub fn write_whole_with(
    tmp: &Path,
    path: &Path,
    write: impl FnOnce(&mut dyn io::Write) -> io::Result<()>,
) -> io::Result<()> {
    let mut out = io::BufWriter::with_capacity(64 << 10, create_private(tmp)?);
    write(&mut out)?;
    let f = out.into_inner().map_err(io::IntoInnerError::into_error)?;
    f.sync_all()?;
    std::fs::rename(tmp, path)?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => fsync_dir(dir),
        _ => fsync_dir(Path::new(".")),
    }
}

/// Makes a folder's entries (files created, renamed or removed in it) durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` if missing; a new folder's own entry is made durable too.
pub fn create_dir(dir: &Path) -> Result<(), String> {
    let existed = dir.exists();
    create_private_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
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
