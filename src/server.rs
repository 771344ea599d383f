//! Accepting connections: HTTP/1.1 and HTTP/2 (prior knowledge, or ALPN over TLS), the header
//! read timeout, and a bounded graceful drain.

use std::convert::Infallible;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::config::TlsConfig;
use crate::framing::{FramingGuard, Guarded};
use crate::idle::{Busy, Counted, Idle};
use crate::upstream::ProxyBody;

/// Builds the listener's TLS acceptor (ALPN: h2, http/1.1).
pub fn tls_acceptor(tls: &TlsConfig) -> Result<TlsAcceptor, String> {
    let what = |p: &Path, e: &dyn std::fmt::Display| format!("server.tls: {}: {e}", p.display());
    let certs = CertificateDer::pem_file_iter(&tls.cert)
        .map_err(|e| what(&tls.cert, &e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| what(&tls.cert, &e))?;
    let key = PrivateKeyDer::from_pem_file(&tls.key).map_err(|e| what(&tls.key, &e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| format!("server.tls: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// The largest HTTP/1 request head (request line and headers) accepted; a larger one gets 431
/// from hyper (HTTP/2 header lists: hyper's 16 KiB). hyper's default is about 400 KiB. A write's
/// path and headers go into its record and write-log entry, which this keeps within the embedded
/// store's bounds (`store::sled::RECORD_MAX`); nginx accepts 32 KiB by default.
pub const HEAD_MAX: usize = 64 * 1024;

/// How one listener serves.
#[derive(Clone)]
pub struct Listen {
    pub header_timeout: Duration,
    pub drain_timeout: Duration,
    /// Connections served at once; the next is accepted when one closes.
    pub max_connections: usize,
    pub tls: Option<TlsAcceptor>,
}

/// Serves `handler` on `listener` until `shutdown` resolves, then stops accepting and waits up
/// to `drain_timeout` for open connections to finish. Returns whether the drain completed.
pub async fn serve<H, F>(
    listener: TcpListener,
    opts: Listen,
    handler: H,
    shutdown: impl Future<Output = ()>,
) -> bool
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // No timer for HTTP/1: hyper's header read timer would allocate and register a timer for
    // every request; the framing guard bounds each head with one timer a connection instead
    // (crate::framing). hyper's default limit of 100 headers applies; setting it explicitly,
    // even to 100, makes hyper build its header arrays element by element for every request.
    builder.http1().max_buf_size(HEAD_MAX);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    // Bounded like mini-redis: a permit before each accept, so that past the limit connections
    // wait in the kernel's backlog instead of holding a descriptor and a task each here.
    let permits = Arc::new(tokio::sync::Semaphore::new(opts.max_connections));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        let handler = handler.clone();
        let watcher = graceful.watcher();
        let opts = opts.clone();
        // In place: the connection's own wakes do not wake the runtime's other worker.
        tokio::spawn(crate::inplace::in_place(async move {
            let _permit = permit;
            // An idle connection is closed after header_timeout, HTTP/2 too (crate::idle).
            let busy = Busy::default();
            let requests = busy.clone();
            let svc = service_fn(move |req| {
                let h = handler.clone();
                let guard = requests.begin();
                async move {
                    let resp = h(req).await;
                    Ok::<_, Infallible>(resp.map(|inner| Counted {
                        inner,
                        _guard: guard,
                    }))
                }
            });
            let idle = |io| Idle::new(io, busy.clone(), opts.header_timeout);
            let result = match &opts.tls {
                None => {
                    let io = TokioIo::new(
                        FramingGuard::new(idle(stream))
                            .with_header_timeout(opts.header_timeout, busy.clone()),
                    );
                    let conn = builder.serve_connection(io, svc);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    let tls = match tokio::time::timeout(
                        opts.header_timeout,
                        acceptor.accept(idle(stream)),
                    )
                    .await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    // The guard is for HTTP/1 framing; HTTP/2 frames carry their own lengths.
                    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                    let io = TokioIo::new(if h2 {
                        Guarded::Plain(tls)
                    } else {
                        Guarded::Guarded(
                            FramingGuard::new(tls)
                                .with_header_timeout(opts.header_timeout, busy.clone()),
                        )
                    });
                    let conn = builder.serve_connection(io, svc);
                    watcher.watch(conn.into_owned()).await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }));
    }
    drop(listener);
    tracing::info!(
        open = graceful.count(),
        "stopped accepting; draining connections"
    );
    match tokio::time::timeout(opts.drain_timeout, graceful.shutdown()).await {
        Ok(()) => true,
        Err(_) => {
            tracing::warn!("drain_timeout reached with connections still open");
            false
        }
    }
}
