//! What keying a write's identity with the store's secret costs (SPEC §13): the principal, the
//! identity (fingerprint, key, action id) and the body digest of one write, plain SHA-256 (a
//! store from before secrets) against HMAC-SHA-256, interleaved in the same run.
//!
//! `cargo bench --bench identity`

use oncegate::identity::{identify, principal, Keyer, WriteRequest};

const ROUNDS: usize = 5;
const WRITES: u32 = 500_000;

fn main() {
    let cfg = oncegate::config::Config::parse(
        "[server]\n[[upstreams]]\nname='a'\nprefix='/a'\nurl='http://127.0.0.1:1'\n",
    )
    .expect("config");
    let policy = cfg.upstreams[0].policy.as_ref().clone();
    let mut h = http::HeaderMap::new();
    h.insert("content-type", "application/json".parse().expect("value"));
    h.insert(
        "authorization",
        "Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc"
            .parse()
            .expect("value"),
    );
    let body =
        br#"{"amount":4217,"currency":"usd","customer":"cus_123","metadata":{"order":"o-1"}}"#;
    let one = |k: &Keyer| {
        let p = principal(&h, &policy, k);
        let req = WriteRequest {
            upstream: "a",
            method: "POST",
            rest: "/v1/charges",
            query: "",
            headers: &h,
            body,
            principal: &p,
            keyer: k,
        };
        let id = identify(&req, &policy).expect("identity");
        id.action_id.len() + k.body(body).len()
    };
    let (plain, keyed) = (Keyer::unkeyed(), Keyer::new(&[7; 32]));
    let mut best = [f64::MAX; 2];
    for _ in 0..ROUNDS {
        for (i, k) in [&plain, &keyed].into_iter().enumerate() {
            let t = std::time::Instant::now();
            let mut sink = 0;
            for _ in 0..WRITES {
                sink += std::hint::black_box(one(k));
            }
            std::hint::black_box(sink);
            best[i] = best[i].min(t.elapsed().as_nanos() as f64 / f64::from(WRITES));
        }
    }
    println!("| identity of one write | ns (best of {ROUNDS} rounds) |");
    println!("|---|---:|");
    println!(
        "| plain SHA-256 (a store from before secrets) | {:.0} |",
        best[0]
    );
    println!("| keyed, HMAC-SHA-256 | {:.0} |", best[1]);
    println!(
        "| keyed − plain | {:.0} ({:.2}×) |",
        best[1] - best[0],
        best[1] / best[0]
    );
}
