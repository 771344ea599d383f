//! MCP tool calls (SPEC §14): JSON-RPC over Streamable HTTP, guarded by what the messages say.
//!
//! Pure parts, no I/O: the proxy's write path calls them through its one protocol seam
//! (`proxy::Call`).
//!
//! - `message.rs`: what a POST holds (§14.1): a `tools/call`, a batch, or anything else (a read);
//! - `classify.rs`: a tool's class from `[[upstreams.tools]]` and learned annotations;
//! - `identity.rs`: a tool call's key and fingerprint (§14.2);
//! - `calls.rs`: the guarded calls seen, by what a client's cancel names (§14.3);
//! - `stream.rs`: SSE events as they arrive, the final response, and the outcome (§14.3);
//! - `answer.rs`: replays and problems as JSON-RPC (§14.4);
//! - `origin.rs`: DNS rebinding protection in the server's place (§14.6);
//! - `oauth.rs`: the server's OAuth metadata routed and named as the proxy's (§14.6).

pub mod answer;
pub mod calls;
pub mod classify;
pub mod identity;
pub mod message;
pub mod oauth;
pub mod origin;
pub mod stream;

pub use classify::Annotations;
pub use message::{intake, Intake, ToolCall};
