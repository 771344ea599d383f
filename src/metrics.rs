//! Metrics from one registry, passed down (never global), served on the admin listener as
//! Prometheus text.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::minutes::Minutes;

/// Label values are `&'static str` so that counting a request allocates nothing: classes and
/// outcomes are constants, and upstream names are interned once (see [`intern`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub upstream: &'static str,
    pub class: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub upstream: &'static str,
}

/// A `'static` copy of an upstream name, made once per name for the life of the process (the
/// set of upstreams is fixed by the config).
pub fn intern(name: &str) -> &'static str {
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.push(leaked);
    leaked
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: &'static str,
}

/// The phases of a write a duration is kept for: `claim` (made durable before the request
/// leaves), `send` (the upstream's answer, all tries), `settle` (the outcome made durable
/// before the client hears it).
pub const PHASES: [&str; 3] = ["claim", "send", "settle"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MadeLabels {
    pub made: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WaitLabels {
    pub wait: &'static str,
}

/// The outcome of a request forwarded as it came (a read).
pub const FORWARDED: &str = "forwarded";

fn latency() -> Histogram {
    // 0.5 ms .. ~16 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub upstream_latency: Family<UpstreamLabels, Histogram, fn() -> Histogram>,
    pub actions: Family<StateLabels, Gauge>,
    pub flush_latency: Histogram,
    /// How the store's batches were made (PostgreSQL), resolved once.
    pub batches: crate::store::BatchCounts,
    /// How often the embedded store's syncs waited for sled, resolved once.
    pub drainer_waits: crate::store::DrainerWaits,
    /// Handles made once per phase, so that observing one is a lookup-free call.
    write_phases: [Histogram; 3],
    pub lookups: Family<ResultLabels, Counter>,
    pub log_head: Gauge,
    /// The last hour by minute, for the console's chart.
    pub minutes: Minutes,
    /// Each upstream's handles for what every read counts, resolved once ([`Metrics::prepare`]).
    hot: std::sync::OnceLock<Vec<Hot>>,
}

/// The series a forwarded read updates, held so that counting one hashes no labels.
struct Hot {
    upstream: &'static str,
    /// `requests{class="read", outcome="forwarded"}`.
    forwarded: Counter,
    latency: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("oncegate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by upstream, class and Oncegate-Outcome",
            requests.clone(),
        );
        let upstream_latency =
            Family::<UpstreamLabels, Histogram, fn() -> Histogram>::new_with_constructor(latency);
        registry.register(
            "upstream_latency_seconds",
            "Time to the upstream's answer head, per try",
            upstream_latency.clone(),
        );
        let actions = Family::<StateLabels, Gauge>::default();
        registry.register("actions", "Stored actions by state", actions.clone());
        let flush_latency = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        registry.register(
            "store_flush_seconds",
            "Duration of one durable store flush (a group commit)",
            flush_latency.clone(),
        );
        let made = Family::<MadeLabels, Counter>::default();
        registry.register(
            "store_batches",
            "PostgreSQL batches: committed as one statement, after reading the log's head under lock, after reading their rows under lock, or made again (what one assumed had changed)",
            made.clone(),
        );
        let count = |made_as| made.get_or_create(&MadeLabels { made: made_as }).clone();
        let batches = crate::store::BatchCounts {
            one_statement: count("one_statement"),
            head_locked: count("head_locked"),
            under_lock: count("under_lock"),
            again: count("again"),
        };
        let waits = Family::<WaitLabels, Counter>::default();
        registry.register(
            "store_drainer_waits",
            "Embedded store: syncs that waited for sled to catch up, a batch's worth (eased) or a whole drain (whole_drain); writes then go at sled's pace",
            waits.clone(),
        );
        let wait = |wait| waits.get_or_create(&WaitLabels { wait }).clone();
        let drainer_waits = crate::store::DrainerWaits {
            eased: wait("eased"),
            whole_drain: wait("whole_drain"),
        };
        let phases =
            Family::<PhaseLabels, Histogram, fn() -> Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000025, 2.0, 18))
            });
        registry.register(
            "write_phase_seconds",
            "Duration of each phase of a write: claim, send, settle",
            phases.clone(),
        );
        let write_phases = PHASES.map(|phase| phases.get_or_create(&PhaseLabels { phase }).clone());
        let lookups = Family::<ResultLabels, Counter>::default();
        registry.register("lookups", "Status lookups by result", lookups.clone());
        let log_head = Gauge::default();
        registry.register(
            "log_head_seq",
            "Sequence number of the newest write-log entry",
            log_head.clone(),
        );
        Metrics {
            registry,
            requests,
            upstream_latency,
            actions,
            flush_latency,
            batches,
            drainer_waits,
            write_phases,
            lookups,
            log_head,
            minutes: Minutes::default(),
            hot: std::sync::OnceLock::new(),
        }
    }

    /// Resolves, once, the series each upstream's reads update. Reads of an upstream not named
    /// here are counted all the same, through the label lookup.
    pub fn prepare(&self, upstreams: impl Iterator<Item = &'static str>) {
        let _ = self.hot.set(
            upstreams
                .map(|upstream| Hot {
                    upstream,
                    forwarded: self
                        .requests
                        .get_or_create(&RequestLabels {
                            upstream,
                            class: crate::route::Class::Read.as_str(),
                            outcome: FORWARDED,
                        })
                        .clone(),
                    latency: self
                        .upstream_latency
                        .get_or_create(&UpstreamLabels { upstream })
                        .clone(),
                })
                .collect(),
        );
    }

    fn hot(&self, upstream: &str) -> Option<&Hot> {
        self.hot.get()?.iter().find(|h| h.upstream == upstream)
    }

    pub fn request(&self, upstream: &'static str, class: &'static str, outcome: &'static str) {
        if class == crate::route::Class::Write.as_str() {
            self.minutes.write(outcome);
        } else if outcome == FORWARDED && class == crate::route::Class::Read.as_str() {
            if let Some(h) = self.hot(upstream) {
                h.forwarded.inc();
                return;
            }
        }
        self.requests
            .get_or_create(&RequestLabels {
                upstream,
                class,
                outcome,
            })
            .inc();
    }

    pub fn lookup(&self, result: &str) {
        self.lookups
            .get_or_create(&ResultLabels {
                result: result.to_string(),
            })
            .inc();
    }

    pub fn upstream_latency(&self, upstream: &'static str, seconds: f64) {
        if let Some(h) = self.hot(upstream) {
            h.latency.observe(seconds);
            return;
        }
        self.upstream_latency
            .get_or_create(&UpstreamLabels { upstream })
            .observe(seconds);
    }

    /// A write spent `seconds` in `phase` (one of [`PHASES`]).
    pub fn write_phase(&self, phase: &'static str, seconds: f64) {
        if let Some(i) = PHASES.iter().position(|p| *p == phase) {
            self.write_phases[i].observe(seconds);
        }
    }

    /// The registry as Prometheus text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
