//! Stored response bodies: small ones in sled, larger ones as files beside it.

use super::*;

impl SledStore {
    /// A stored body as the client gets it: opened when sealed.
    pub(super) fn open_body(&self, stored: &[u8]) -> Result<Bytes, StoreError> {
        match &self.sealer {
            None => Ok(Bytes::copy_from_slice(stored)),
            Some(s) => s
                .open(stored)
                .map(Bytes::from)
                .map_err(|reason| StoreError::Corrupt {
                    id: "a stored body".into(),
                    reason,
                }),
        }
    }

    pub(super) fn body_path(&self, sha: &str) -> PathBuf {
        self.dir.join("bodies").join(sha)
    }

    /// Writes a large body as a content-addressed file: write, fsync, rename, fsync the folder.
    /// Named by `name`, the plain body's digest under the store's secret (so that a file's name
    /// does not let a reader test a guessed body); with a sealer the file holds the sealed body.
    pub(super) fn write_body_file(
        dir: PathBuf,
        name: String,
        body: Bytes,
        sealer: Option<Arc<Sealer>>,
    ) -> std::io::Result<String> {
        let sha = name;
        let body = seal_opt(sealer.as_deref(), &body);
        let bodies = dir.join("bodies");
        let path = bodies.join(&sha);
        if path.exists() {
            return Ok(sha);
        }
        let tmp = bodies.join(format!(".{sha}.{}.tmp", std::process::id()));
        files::write_whole(&tmp, &path, &body)?;
        Ok(sha)
    }

    /// Places a body to keep: inline for small ones, a durable file for large ones.
    pub(super) async fn place_body(
        &self,
        body: &mut Option<Bytes>,
        r: &mut BodyRef,
    ) -> Result<(), StoreError> {
        let Some(b) = body.as_ref() else {
            return Ok(());
        };
        if b.len() > INLINE_BODY_MAX {
            // Announced before the file is written and until its record is committed, so that
            // the sweeper never removes a body file a settlement is about to point at.
            let sha = self.keyer.body(b);
            self.placing(&sha, 1);
            let (dir, bytes, sealer) = (self.dir.clone(), b.clone(), self.sealer.clone());
            let name = sha.clone();
            let written = tokio::task::spawn_blocking(move || {
                Self::write_body_file(dir, name, bytes, sealer)
            })
            .await
            .map_err(unavailable)
            .and_then(|r| r.map_err(unavailable));
            if let Err(e) = written {
                self.placing(&sha, -1);
                return Err(e);
            }
            *r = BodyRef::File { sha256: sha };
            *body = None;
        } else {
            *r = BodyRef::Inline;
        }
        Ok(())
    }
}
