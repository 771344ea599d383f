//! Phase `send` of an MCP tool call answered with an SSE stream (SPEC §14.3): events go to the
//! client as they arrive, the final response is held until its outcome is durable, and a client
//! that goes away cancels nothing: the stream is read to its final response and recorded.

use tokio::sync::mpsc;

use super::*;
use crate::action::{Phase, EVIDENCE_BODY_MAX};
use crate::mcp::{answer, stream};
use crate::upstream::ChannelBody;

/// Events waiting for a slow client. Past this, progress events are dropped for that client
/// (never the final response): the call's progress never waits on its client.
const CLIENT_QUEUE: usize = 64;

/// Room beyond `max_stored_response` for one event still being read.
const EVENT_SLACK: usize = 64 * 1024;

/// How a relayed stream ended.
pub(super) struct Relayed {
    /// The client's side of the stream (dropped by the client when it went away); `None` when
    /// the server ended it for the client to resume (SEP-1699): the final response reaches the
    /// client on its resumed stream, from the server.
    to_client: Option<mpsc::Sender<Bytes>>,
    /// The final JSON-RPC response to the request, when it came.
    last: Option<Bytes>,
    /// Why there is no final response.
    lost: Option<String>,
    /// A stream still open when its events stopped within the timeout: read on, so that a late
    /// final response settles the unknown outcome (closing it could cancel the call).
    late: Option<(Incoming, stream::Events)>,
}

/// A final response as a try's evidence: its first [`EVIDENCE_BODY_MAX`] bytes, cut on a
/// character boundary.
fn evidence(data: &[u8]) -> String {
    let text = String::from_utf8_lossy(data);
    let n = text.len().min(EVIDENCE_BODY_MAX);
    let cut = (0..=n)
        .rev()
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    text[..cut].to_string()
}

/// How long a stream that went quiet is read on for a late final response.
pub(super) const LATE_PATIENCE: Duration = Duration::from_secs(300);

impl Proxy {
    /// Answers the client with the stream's head at once, then relays its events until the
    /// final response to this request.
    pub(super) async fn relay(
        &self,
        job: &mut WriteJob,
        rec: &Record,
        mut head: http::response::Parts,
        mut body: Incoming,
        tries: &mut [Try],
    ) -> Relayed {
        let Call::Mcp(call) = &job.call else {
            unreachable!("only MCP calls relay")
        };
        let (to_client, rx) = mpsc::channel(CLIENT_QUEUE);
        head.headers.remove(http::header::CONTENT_LENGTH);
        let mut resp = Response::from_parts(head, ChannelBody(rx).boxed_unsync());
        // The outcome is not known yet: it is the final event's, and the record's.
        write_headers(resp.headers_mut(), rec, Outcome::Sent);
        resp.headers_mut().remove("oncegate-outcome");
        if let Some(early) = job.early.take() {
            // Refused when the client is gone: the call is read to its end all the same.
            let _ = early.send(resp);
        }
        let limit = self.config.server.max_stored_response as usize + EVENT_SLACK;
        let mut events = stream::Events::default();
        // Set when an event outgrew the limit: the rest is passed through unparsed.
        let mut oversized = false;
        // The id of the last event that carried one: where the stream can be resumed.
        let mut resume_at: Option<String> = None;
        let lost = loop {
            let frame = tokio::select! {
                f = tokio::time::timeout(job.policy.timeout, body.frame()) => f,
                () = self.deadline.cancelled() => {
                    break "the proxy stopped (drain_timeout) while the answer streamed".to_string()
                }
            };
            let data = match frame {
                Err(_) if !oversized => {
                    let error = format!(
                        "no event within {:?}, and no final response",
                        job.policy.timeout
                    );
                    return Relayed {
                        to_client: Some(to_client),
                        last: None,
                        lost: Some(error),
                        late: Some((body, events)),
                    };
                }
                Err(_) => {
                    break format!(
                        "no event within {:?}, and no final response",
                        job.policy.timeout
                    )
                }
                Ok(None) if oversized => {
                    break "an event of the answer was larger than max_stored_response: its final response could not be read".to_string()
                }
                Ok(None) => match resume_at.take() {
                    // The server ended the stream for the client to resume (SEP-1699): the end
                    // passes through, and the call waits for its final response.
                    Some(at) => {
                        drop(to_client);
                        let last = self.resumed(job, call, at).await;
                        if let (Ok(last), Some(t)) = (&last, tries.last_mut()) {
                            t.body = Some(evidence(last));
                        }
                        let (last, lost) = match last {
                            Ok(last) => (Some(last), None),
                            Err(why) => (None, Some(why)),
                        };
                        return Relayed {
                            to_client: None,
                            last,
                            lost,
                            late: None,
                        };
                    }
                    None => break "the stream ended without the final response".to_string(),
                },
                Ok(Some(Err(e))) => break format!("the stream broke: {e}"),
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
            };
            if oversized {
                let _ = to_client.try_send(data);
                continue;
            }
            for ev in events.push(&data) {
                if ev.id.is_some() {
                    resume_at = ev.id.clone();
                }
                if stream::final_response(ev.data.as_bytes(), &call.id).is_some() {
                    if let Some(t) = tries.last_mut() {
                        t.body = Some(evidence(ev.data.as_bytes()));
                    }
                    return Relayed {
                        to_client: Some(to_client),
                        last: Some(Bytes::from(ev.data)),
                        lost: None,
                        late: None,
                    };
                }
                // A full queue means a client that does not read: it misses a progress event.
                let _ = to_client.try_send(ev.raw);
            }
            if events.pending() > limit {
                oversized = true;
                let _ = to_client.try_send(events.take_rest());
            }
        };
        Relayed {
            to_client: Some(to_client),
            last: None,
            lost: Some(lost),
            late: None,
        }
    }

    /// Phase `settle` of a relayed answer, then its last event: the final response, or the
    /// problem that stands in for it.
    pub(super) async fn settle_relayed(
        &self,
        job: &WriteJob,
        rec: Arc<Record>,
        relayed: Relayed,
        mut tries: Vec<Try>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let Call::Mcp(call) = &job.call else {
            unreachable!("only MCP calls relay")
        };
        let now = (self.clock)();
        let (state, needs) = match &relayed.last {
            Some(last) => match serde_json::from_slice::<Value>(last) {
                Ok(v) => Call::state_of(&stream::verdict(&v)),
                Err(_) => (State::Unknown, false),
            },
            None => (State::Unknown, false),
        };
        if let Some(error) = &relayed.lost {
            tries.push(Try {
                at: crate::action::now_millis(),
                phase: Some(Phase::Body),
                error: Some(error.clone()),
                ..Try::default()
            });
        }
        let limit = self.config.server.max_stored_response;
        let (response, external_id, body) = match (&relayed.last, state) {
            (Some(last), State::Succeeded) => {
                let (stored, kept) = final_stored(last, limit);
                let ext = final_external_id(job, last);
                (Some(stored), ext, kept.then(|| last.clone()))
            }
            _ => (None, None, None),
        };
        let req = SettleRequest {
            id: rec.id.clone(),
            attempt: rec.attempts,
            settlement: Settlement {
                state,
                tries,
                response,
                external_id,
                needs_decision: needs,
                now,
            },
            body,
        };
        let settled = self.settle(req, &rec).await;
        let unknown_now = matches!(&settled, Ok(r) if r.state == State::Unknown);
        let last = match (settled, relayed.last) {
            // The final response, now that its outcome is durable.
            (Ok(_), Some(last)) => last,
            (Ok(rec), None) => {
                let e = ProxyError::OutcomeUnknown {
                    ctx: self.ctx(rec).await,
                    lost_now: true,
                    reason: format!(
                        "{}; the tool may have run",
                        relayed.lost.as_deref().unwrap_or("no final response")
                    ),
                };
                Bytes::from(
                    serde_json::to_vec(&answer::tool_error_json(&e, &call.id, call.modern))
                        .expect("JSON serializes"),
                )
            }
            // Another settled the action first: its client still gets the tool's result.
            (Err(Unsettled::Moved(_)), Some(last)) => last,
            (Err(e), _) => Bytes::from(
                serde_json::to_vec(&answer::tool_error_json(
                    &ProxyError::from(e),
                    &call.id,
                    call.modern,
                ))
                .expect("JSON serializes"),
            ),
        };
        // A client that went away (or stopped reading) does not hold the action's task.
        if let Some(to_client) = relayed.to_client {
            let _ = tokio::time::timeout(job.policy.timeout, to_client.send(answer::event(&last)))
                .await;
        }
        if let (true, Some((body, events))) = (unknown_now, relayed.late) {
            self.read_late(job, &rec.id, body, events).await;
        }
        // The client's answer went out with the stream's head.
        Ok(Response::new(crate::upstream::empty()))
    }

    /// Waits on for the head of an answer that did not come within the timeout, then reads it
    /// as [`Proxy::read_late`] does.
    pub(super) async fn await_late(
        &self,
        job: &WriteJob,
        id: &str,
        pending: hyper_util::client::legacy::ResponseFuture,
    ) {
        let head = tokio::select! {
            r = tokio::time::timeout(LATE_PATIENCE, pending) => r,
            () = self.stopping.cancelled() => return,
        };
        let Ok(Ok(resp)) = head else {
            return;
        };
        if !resp.status().is_success() {
            return;
        }
        let sse = crate::upstream::is_event_stream(resp.headers());
        let body = resp.into_body();
        if sse {
            self.read_late(job, id, body, stream::Events::default())
                .await;
        } else {
            self.read_late_json(job, id, body).await;
        }
    }

    /// A late JSON answer: read whole (within `max_stored_response`), then settled like a late
    /// final event.
    async fn read_late_json(&self, job: &WriteJob, id: &str, body: Incoming) {
        let limit = self.config.server.max_stored_response as usize;
        let read = tokio::select! {
            r = tokio::time::timeout(
                LATE_PATIENCE,
                http_body_util::Limited::new(body, limit).collect(),
            ) => r,
            () = self.stopping.cancelled() => return,
        };
        if let Ok(Ok(all)) = read {
            self.settle_late(job, id, all.to_bytes()).await;
        }
    }

    /// Reads a quiet stream on, up to [`LATE_PATIENCE`]: a final response that comes settles
    /// the unknown action as the upstream's own answer would have (logged as a lookup).
    async fn read_late(
        &self,
        job: &WriteJob,
        id: &str,
        mut body: Incoming,
        mut events: stream::Events,
    ) {
        let Call::Mcp(call) = &job.call else {
            return;
        };
        let limit = self.config.server.max_stored_response as usize + EVENT_SLACK;
        let give_up = tokio::time::Instant::now() + LATE_PATIENCE;
        let last = 'read: loop {
            let frame = tokio::select! {
                f = tokio::time::timeout_at(give_up, body.frame()) => f,
                () = self.stopping.cancelled() => return,
            };
            let Ok(Some(Ok(frame))) = frame else {
                return;
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            for ev in events.push(&data) {
                if stream::final_response(ev.data.as_bytes(), &call.id).is_some() {
                    break 'read Bytes::from(ev.data);
                }
            }
            if events.pending() > limit {
                return;
            }
        };
        self.settle_late(job, id, last).await;
    }

    /// Settles an unknown call from its final response, come late (logged as a lookup: the
    /// upstream's own word).
    async fn settle_late(&self, job: &WriteJob, id: &str, last: Bytes) {
        let Call::Mcp(call) = &job.call else {
            return;
        };
        let Some(v) = stream::final_response(&last, &call.id) else {
            return;
        };
        let applied = match Call::state_of(&stream::verdict(&v)).0 {
            State::Succeeded => true,
            State::Failed => false,
            _ => return,
        };
        let (stored, kept) = final_stored(&last, self.config.server.max_stored_response);
        let kept = applied && kept;
        let res = crate::action::Resolve {
            applied,
            external_id: final_external_id(job, &last),
            response: applied.then_some(stored),
            body: kept.then_some(last),
            actor: "lookup".into(),
            reason: "the tool's final response arrived after the timeout, on the same stream"
                .into(),
            now: (self.clock)(),
            absent_after: None,
        };
        match self.store.resolve(id.to_string(), res, Event::Lookup).await {
            Ok(_) => tracing::info!(
                action = id,
                applied,
                "a late final response settled an unknown tool call"
            ),
            Err(e) => {
                tracing::warn!(action = id, error = %e, "a late final response could not settle the action")
            }
        }
    }
}

/// The stored form of a call's final response (replayed as JSON), and whether its bytes are kept
/// (within `max_stored_response`).
fn final_stored(last: &Bytes, limit: u64) -> (StoredResponse, bool) {
    let kept = last.len() as u64 <= limit;
    let stored = StoredResponse {
        status: 200,
        headers: vec![("content-type".into(), "application/json".into())],
        size: last.len() as u64,
        body: if kept {
            BodyRef::Inline
        } else {
            BodyRef::Absent
        },
        source: Source::Upstream,
    };
    (stored, kept)
}

/// The external id a policy's JSON pointer finds in a call's final response.
fn final_external_id(job: &WriteJob, last: &[u8]) -> Option<String> {
    (job.policy.external_id.as_deref()).and_then(|spec| external_id(spec, &HeaderMap::new(), last))
}
