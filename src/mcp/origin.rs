//! DNS rebinding protection for MCP upstreams (SPEC §14.6). The proxy rewrites `Host`, so a
//! server's own check (the MCP SDKs' default on localhost) never sees the name a browser used:
//! the proxy makes that check in its place.
//!
//! A web page that rebinds its name to the proxy's address sends its own origin and its own
//! name as `Host`. So: an `Origin` is refused unless `allowed_origins` lists it, or it names a
//! loopback host and the listener is loopback (a local page); and on a loopback listener, a
//! `Host` that names another host than a loopback one (or one of the allowed origins') is refused.

use std::net::SocketAddr;

/// Why a request is refused as coming from a foreign page, or `None`.
pub fn foreign(
    origin: Option<&[u8]>,
    host: Option<&str>,
    local: Option<SocketAddr>,
    allowed: &[String],
) -> Option<String> {
    let loopback = local.is_some_and(|a| a.ip().is_loopback());
    if let Some(o) = origin {
        let o = String::from_utf8_lossy(o).trim().to_ascii_lowercase();
        let listed = allowed.contains(&o);
        let local_page = loopback && origin_host(&o).is_some_and(is_loopback_name);
        if !listed && !local_page {
            return Some(format!(
                "requests from web pages of the origin {o:?} are refused (allowed_origins)"
            ));
        }
    }
    if loopback {
        let h = host.unwrap_or("").trim().to_ascii_lowercase();
        let name = strip_port(&h);
        let listed = allowed
            .iter()
            .any(|a| origin_host(a).is_some_and(|ah| ah == name));
        if !is_loopback_name(name) && !listed {
            return Some(format!(
                "requests for the host {h:?} are refused on a loopback listener"
            ));
        }
    }
    None
}

/// The host of an origin (`scheme://host[:port]`), without its port.
fn origin_host(origin: &str) -> Option<&str> {
    let (_, rest) = origin.split_once("://")?;
    Some(strip_port(rest))
}

/// `host[:port]` or `[v6][:port]` without the port.
fn strip_port(authority: &str) -> &str {
    if let Some(v6) = authority.strip_prefix('[') {
        return v6
            .split(']')
            .next()
            .map_or(authority, |h| &authority[..h.len() + 2]);
    }
    authority.split(':').next().unwrap_or(authority)
}

fn is_loopback_name(host: &str) -> bool {
    matches!(host, "localhost" | "[::1]")
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether `s` is an origin as `allowed_origins` takes it: `http://` or `https://`, a host, an
/// optional port, nothing after.
pub fn is_origin(s: &str) -> bool {
    let Some((scheme, rest)) = s.split_once("://") else {
        return false;
    };
    matches!(scheme, "http" | "https")
        && !rest.is_empty()
        && !rest.contains(['/', '?', '#', '@', ' '])
        && s == s.to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOP: Option<SocketAddr> = Some(SocketAddr::new(
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        8080,
    ));

    #[test]
    fn a_rebound_page_is_refused_and_a_local_one_is_not() {
        let evil = Some(b"http://evil.example.com".as_slice());
        assert!(foreign(evil, Some("evil.example.com"), LOOP, &[]).is_some());
        // The Host alone (no Origin: a non-browser client that was rebound, or curl -H).
        assert!(foreign(None, Some("evil.example.com:8080"), LOOP, &[]).is_some());
        for h in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "LOCALHOST",
        ] {
            let o = format!("http://{}", h.to_ascii_lowercase());
            assert_eq!(foreign(Some(o.as_bytes()), Some(h), LOOP, &[]), None, "{h}");
            assert_eq!(foreign(None, Some(h), LOOP, &[]), None, "{h}");
        }
        assert!(foreign(Some(b"null"), Some("localhost"), LOOP, &[]).is_some());
    }

    #[test]
    fn allowed_origins_admit_their_pages_and_names() {
        let allowed = vec!["https://app.example.com".to_string()];
        let o = Some(b"https://app.example.com".as_slice());
        assert_eq!(foreign(o, Some("app.example.com"), LOOP, &allowed), None);
        let other = Some(b"https://app.example.com.evil.net".as_slice());
        assert!(foreign(other, Some("localhost"), LOOP, &allowed).is_some());
        // Off loopback, the Host is the network's business; a foreign Origin is still refused.
        let remote = Some("10.0.0.5:8080".parse().expect("an address"));
        assert_eq!(foreign(None, Some("proxy.internal"), remote, &[]), None);
        let local_page = Some(b"http://localhost:3000".as_slice());
        assert!(foreign(local_page, Some("proxy.internal"), remote, &[]).is_some());
    }

    #[test]
    fn origins_are_scheme_host_and_port() {
        assert!(is_origin("https://app.example.com"));
        assert!(is_origin("http://localhost:3000"));
        for bad in [
            "app.example.com",
            "https://a/b",
            "ftp://a",
            "https://",
            "HTTPS://A",
        ] {
            assert!(!is_origin(bad), "{bad}");
        }
    }
}
