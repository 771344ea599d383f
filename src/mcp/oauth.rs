//! Authorization through the proxy (MCP 2025-06-18 and later, SPEC §14.6). An MCP server behind
//! OAuth names its own URL: in its protected-resource metadata (RFC 9728) and in the
//! `resource_metadata` of its `WWW-Authenticate` challenge. A client that reached it through
//! the proxy refuses metadata for another resource than the one it called, so the proxy routes
//! that metadata and rewrites those URLs to its own for the upstream. Tokens pass through.
//!
//! Pure parts: which upstream a well-known path names, and the rewrites.

use serde_json::Value;

/// Where RFC 9728 puts a resource's metadata: this, then the resource's path.
pub const PROTECTED_RESOURCE: &str = "/.well-known/oauth-protected-resource";

/// Paths a 2025-03-26 client derives from the server's origin when it finds no metadata: the
/// authorization server's metadata and its default endpoints.
pub const FALLBACK: &[&str] = &[
    "/.well-known/oauth-authorization-server",
    "/authorize",
    "/token",
    "/register",
];

/// An upstream as the rewrites see it: its base URL (`http://server:9000/mcp`) and its prefix on
/// the proxy (`/mcp`).
pub struct Mount<'a> {
    pub url: &'a str,
    pub prefix: &'a str,
}

impl Mount<'_> {
    /// The server's origin (`http://server:9000`) and base path (`/mcp`, or empty).
    fn split(&self) -> (&str, &str) {
        let after_scheme = self.url.find("://").map_or(0, |i| i + 3);
        match self.url[after_scheme..].find('/') {
            Some(i) => self.url.split_at(after_scheme + i),
            None => (self.url, ""),
        }
    }

    /// The resource as a client of the proxy knows it: `origin` (the proxy's, as the client
    /// called it) and the prefix.
    pub fn resource(&self, origin: &str) -> String {
        format!("{origin}{}", self.prefix.trim_end_matches('/'))
    }

    /// The server's own URL for its metadata at `rest` (the path after the prefix, under the
    /// well-known path).
    pub fn metadata_at(&self, rest: &str) -> String {
        let (origin, base) = self.split();
        format!(
            "{origin}{PROTECTED_RESOURCE}{}{rest}",
            base.trim_end_matches('/')
        )
    }

    /// The server's root metadata, for a server that keeps it there.
    pub fn root_metadata(&self) -> String {
        format!("{}{PROTECTED_RESOURCE}", self.split().0)
    }

    /// A fallback path at the server's origin.
    pub fn at_origin(&self, path_and_query: &str) -> String {
        format!("{}{path_and_query}", self.split().0)
    }

    /// A `WWW-Authenticate` value with its `resource_metadata` URL, when it names metadata at
    /// this server's origin, turned into the proxy's for this upstream; with the path of the
    /// server's metadata (which may be anywhere at its origin), for the proxy to fetch it from.
    /// `None`: nothing to rewrite.
    pub fn challenge(&self, value: &str, origin: &str) -> Option<(String, String)> {
        const PARAM: &str = "resource_metadata=\"";
        let start = value.find(PARAM)? + PARAM.len();
        let len = value[start..].find('"')?;
        let named = &value[start..start + len];
        let (server_origin, _) = self.split();
        let path = named.strip_prefix(server_origin)?;
        if !path.starts_with('/') {
            return None;
        }
        let ours = format!(
            "{origin}{PROTECTED_RESOURCE}{}",
            self.prefix.trim_end_matches('/')
        );
        let rewritten = format!("{}{ours}{}", &value[..start], &value[start + len..]);
        Some((rewritten, path.to_string()))
    }

    /// Protected-resource metadata with its `resource` (the server's URL, or one under it)
    /// turned into the proxy's. `None`: not metadata of this server.
    pub fn metadata(&self, body: &[u8], origin: &str) -> Option<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let resource = v.get("resource")?.as_str()?.to_string();
        let (server_origin, base) = self.split();
        let base = base.trim_end_matches('/');
        let path = resource.strip_prefix(server_origin)?;
        if !(path.is_empty() || path.starts_with('/')) {
            return None;
        }
        // A resource under the server's base path keeps its place under the prefix; one above
        // it (the server's origin: metadata at the root) covers the upstream, so it names the
        // upstream's mount on the proxy.
        let under = match path.strip_prefix(base) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            _ if base.starts_with(path.trim_end_matches('/')) => "",
            _ => return None,
        };
        v["resource"] = Value::String(format!("{}{under}", self.resource(origin)));
        serde_json::to_vec(&v).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Mount = Mount {
        url: "http://127.0.0.1:9000/mcp",
        prefix: "/tools",
    };
    const P: &str = "http://127.0.0.1:8080";

    #[test]
    fn the_challenge_names_the_proxys_metadata() {
        let h = r#"Bearer error="invalid_token", resource_metadata="http://127.0.0.1:9000/.well-known/oauth-protected-resource/mcp", scope="files""#;
        assert_eq!(
            M.challenge(h, P).map(|c| c.0).as_deref(),
            Some(
                r#"Bearer error="invalid_token", resource_metadata="http://127.0.0.1:8080/.well-known/oauth-protected-resource/tools", scope="files""#
            )
        );
        // Another server's metadata, or none: left as it is.
        assert_eq!(M.challenge(r#"Bearer resource_metadata="https://as.example/.well-known/oauth-protected-resource""#, P), None);
        assert_eq!(M.challenge("Bearer", P), None);
        // Metadata at a place of the server's choosing: fetched from there.
        let custom = r#"Bearer resource_metadata="http://127.0.0.1:9000/custom/metadata.json""#;
        let (ours, at) = M.challenge(custom, P).expect("rewritten");
        assert_eq!(at, "/custom/metadata.json");
        assert!(ours.contains("http://127.0.0.1:8080/.well-known/oauth-protected-resource/tools"));
    }

    #[test]
    fn the_metadata_names_the_resource_the_client_called() {
        let body = br#"{"resource":"http://127.0.0.1:9000/mcp","authorization_servers":["http://127.0.0.1:9100"]}"#;
        let out: Value =
            serde_json::from_slice(&M.metadata(body, P).expect("rewritten")).expect("JSON");
        assert_eq!(out["resource"], "http://127.0.0.1:8080/tools");
        assert_eq!(
            out["authorization_servers"][0], "http://127.0.0.1:9100",
            "tokens come from the same place"
        );
        assert!(M
            .metadata(br#"{"resource":"http://other/mcp"}"#, P)
            .is_none());
        assert!(M
            .metadata(br#"{"resource":"http://127.0.0.1:9000/mcpx"}"#, P)
            .is_none());
        assert!(M
            .metadata(br#"{"resource":"http://127.0.0.1:9000/other"}"#, P)
            .is_none());
        // Metadata at the server's root, for its whole origin: the upstream's mount.
        for root in ["http://127.0.0.1:9000", "http://127.0.0.1:9000/"] {
            let body = format!(r#"{{"resource":"{root}"}}"#);
            let out: Value =
                serde_json::from_slice(&M.metadata(body.as_bytes(), P).expect("rewritten"))
                    .expect("JSON");
            assert_eq!(out["resource"], "http://127.0.0.1:8080/tools", "{root}");
        }
        assert_eq!(
            M.metadata_at(""),
            "http://127.0.0.1:9000/.well-known/oauth-protected-resource/mcp"
        );
        assert_eq!(
            M.root_metadata(),
            "http://127.0.0.1:9000/.well-known/oauth-protected-resource"
        );
        assert_eq!(M.at_origin("/token"), "http://127.0.0.1:9000/token");
    }
}
