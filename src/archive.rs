//! `oncegate log archive --dir DIR`: ships the write log off the proxy's volume (issue 59).
//!
//! Each run appends the entries the store holds after the last one archived to DIR, as one file
//! named by the range it holds (`{first:020}-{last:020}.ndjson`), written whole (write, fsync,
//! rename, fsync the folder) so that a crash leaves no half file. A file starts where the one
//! before ended: its first entry's `prev` is that file's last `hash`. So the files of DIR, read
//! in name order, are one chain, which `oncegate log verify --file DIR` checks as a whole, and
//! the store's `log.retention` can prune what is archived while the volume stays bounded.
//!
//! A run that finds the store no longer holds the entry after the last archived one (pruned by
//! `log.retention` before it was archived) still archives what there is, and says which entries
//! are missing: the gap is reported, never hidden.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::cli::{log_export, AdminClient};

/// The archive files of `dir`, in name order (which is seq order).
pub fn files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".ndjson") && !n.starts_with('.'))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// The last entry's `(seq, hash)` of the newest file in `dir`.
fn last_archived(dir: &Path) -> Result<Option<(u64, String)>, String> {
    let Some(newest) = files(dir)?.pop() else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(&newest).map_err(|e| format!("{}: {e}", newest.display()))?;
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .and_then(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|v| Some((v["seq"].as_u64()?, v["hash"].as_str()?.to_string())))
        .ok_or_else(|| {
            format!(
                "{}: its last line is not a write-log entry",
                newest.display()
            )
        })?;
    Ok(Some(last))
}

/// Archives what the store holds after the last entry in `dir`. Returns whether the archive
/// is whole (no gap, every entry chained to the one before) and a report.
pub async fn archive(c: &AdminClient, dir: &Path) -> Result<(bool, String), String> {
    crate::store::files::create_private_dir_all(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let last = last_archived(dir)?;
    let after = last.as_ref().map_or(0, |(seq, _)| *seq);
    let text = log_export(c, after).await?;
    let entries: Vec<Value> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| format!("the admin API sent a line that is not JSON: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let (Some(first), Some(newest)) = (entries.first(), entries.last()) else {
        return Ok((
            true,
            format!(
                "{:#}\n",
                json!({"archived": 0, "after": after, "dir": dir.display().to_string()})
            ),
        ));
    };
    let seq = |v: &Value| v["seq"].as_u64().unwrap_or(0);
    let (first_seq, last_seq) = (seq(first), seq(newest));
    let mut notes = Vec::new();
    let mut whole = true;
    // Where this file takes up: right after the last archived entry, chained to it.
    match &last {
        Some((s, hash)) if first_seq == s + 1 && first["prev"].as_str() != Some(hash) => {
            whole = false;
            notes.push(format!(
                "entry {first_seq} does not follow the archive's last entry {s}: the store's log is not the one archived here"
            ));
        }
        Some((s, _)) if first_seq == s + 1 => {}
        Some((s, _)) => {
            whole = false;
            notes.push(format!(
                "entries {}..{} are no longer in the store (pruned by log.retention before they were archived): archive more often than the retention",
                s + 1,
                first_seq - 1
            ));
        }
        None if first_seq != 1 => notes.push(format!(
            "the store's log starts at entry {first_seq}: earlier entries were pruned before the first archive"
        )),
        None => {}
    }
    // Each entry takes up where the one before ended.
    for pair in entries.windows(2) {
        if seq(&pair[1]) != seq(&pair[0]) + 1 || pair[1]["prev"] != pair[0]["hash"] {
            whole = false;
            notes.push(format!(
                "entry {} does not follow entry {}",
                seq(&pair[1]),
                seq(&pair[0])
            ));
            break;
        }
    }
    let name = format!("{first_seq:020}-{last_seq:020}.ndjson");
    let path = dir.join(&name);
    crate::store::files::write_whole(&dir.join(format!(".{name}.tmp")), &path, text.as_bytes())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let report = json!({
        "archived": entries.len(),
        "first": first_seq,
        "last": last_seq,
        "file": path.display().to_string(),
        "head": format!("{last_seq}:{}", newest["hash"].as_str().unwrap_or("")),
        "whole": whole,
        "notes": notes,
    });
    Ok((whole, format!("{report:#}\n")))
}
