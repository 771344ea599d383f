//! The docs' Python recipes, run against the proxy and a local upstream that stalls the first
//! attempt past the SDK's timeout: each must reach the upstream once. Needs a Python with the
//! SDKs (`ONCEGATE_PYTHON`; `.ci/run` makes one); without it the test says so and skips.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{config, Behavior, FakeUpstream, TestProxy};

/// The Python with the SDKs (`ONCEGATE_PYTHON`). These tests are `#[ignore = "needs a Python
/// …"]`: asked for, a missing Python is a failure, not a skip.
fn python() -> String {
    std::env::var("ONCEGATE_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| panic!("this test needs ONCEGATE_PYTHON: a Python with stripe and openai (as .ci/run makes)"))
}

/// Runs `code` with the Python at `py`, `ONCEGATE_URL` set to the proxy; returns its output,
/// after checking that it succeeded.
async fn run_python(py: String, code: String, proxy: &TestProxy, what: &str) -> String {
    let base = proxy.url("");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(py)
            .args(["-c", &code])
            .env("ONCEGATE_URL", base.trim_end_matches('/'))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{what} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs recipe `name` against an upstream whose first attempt is accepted and answered only
/// after the SDK's own timeout, at a tenth of the recipes' time scale: the recipe's SDK timeout
/// (`timeout`, rewritten by `scale`), the upstream's `timeout` and `in_flight_wait` (`upstream`)
/// all divided by ten, with the relations the recipes state between them.
async fn run_recipe(
    name: &str,
    prefix: &str,
    scale: (&str, &str),
    upstream: &str,
    first_answer: Behavior,
    then: Behavior,
) {
    let py = python();
    let up = FakeUpstream::start().await;
    up.push(Behavior::Delay(
        Duration::from_millis(1600),
        Box::new(first_answer),
    ));
    up.set_default(then);
    let extra = format!(
        "[[upstreams]]\nname = \"sdk\"\nprefix = \"{prefix}\"\nurl = \"{}\"\n{upstream}",
        up.url()
    );
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    let code = support::recipe(name);
    assert!(
        code.contains(scale.0),
        "the {name} recipe no longer says {}",
        scale.0
    );
    let code = code.replace(scale.0, scale.1);
    let stdout = run_python(py, code, &proxy, "the recipe").await;
    assert!(stdout.contains("created"), "{stdout}");
    let posts = up.count_method("POST");
    assert_eq!(
        posts, 1,
        "the {name} SDK's write reached the upstream {posts} times"
    );
    assert!(proxy.admin("GET", "/v1/log/verify", "").await.json()["ok"] == true);
}

/// config.example.toml's Stripe upstream (30 s timeout, 8 s in_flight_wait, per-call keys) and
/// the recipe's 10 s SDK timeout, at a tenth of the scale.
const STRIPE_UPSTREAM: &str =
    "timeout = \"3s\"\nin_flight_wait = \"800ms\"\nclient_keys = \"per-call\"";
const STRIPE_SCALE: (&str, &str) = ("RequestsClient(timeout=10)", "RequestsClient(timeout=1)");
/// config.example.toml's OpenAI upstream (120 s) and the recipe's 150 s SDK timeout, scaled.
const OPENAI_UPSTREAM: &str = "timeout = \"12s\"";
const OPENAI_SCALE: (&str, &str) = ("timeout=150.0", "timeout=15.0");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Python with the stripe and openai SDKs: ONCEGATE_PYTHON (.ci/run makes one); run with `cargo test -- --ignored`"]
async fn the_stripe_recipe_creates_one_customer_despite_a_stalled_first_attempt() {
    let customer = r#"{"id":"cus_recipe","object":"customer","email":"ops@acme.test"}"#;
    run_recipe(
        "stripe",
        "/stripe",
        STRIPE_SCALE,
        STRIPE_UPSTREAM,
        Behavior::json(200, customer),
        Behavior::json(200, customer),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Python with the stripe and openai SDKs: ONCEGATE_PYTHON (.ci/run makes one); run with `cargo test -- --ignored`"]
async fn the_openai_recipe_creates_one_batch_despite_a_stalled_first_attempt() {
    let batch = r#"{"id":"batch_recipe","object":"batch","endpoint":"/v1/chat/completions","input_file_id":"file-abc123","completion_window":"24h","status":"validating","created_at":1700000000}"#;
    run_recipe(
        "openai",
        "/openai",
        OPENAI_SCALE,
        OPENAI_UPSTREAM,
        Behavior::json(200, batch),
        Behavior::json(200, batch),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Python with the stripe and openai SDKs: ONCEGATE_PYTHON (.ci/run makes one); run with `cargo test -- --ignored`"]
async fn the_openai_upload_recipe_uploads_one_file_despite_a_stalled_first_attempt() {
    let file = r#"{"id":"file-recipe","object":"file","bytes":72,"created_at":1700000000,"filename":"requests.jsonl","purpose":"batch","status":"processed"}"#;
    run_recipe(
        "openai-files",
        "/openai",
        OPENAI_SCALE,
        OPENAI_UPSTREAM,
        Behavior::json(200, file),
        Behavior::json(200, file),
    )
    .await;
}

/// A charge accepted by Stripe but answered after the proxy's timeout: the SDK's retry finds it
/// unknown, the search lookup finds the charge, and the SDK gets a `Charge` (SPEC §9 `object`),
/// not a search result; one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Python with the stripe and openai SDKs: ONCEGATE_PYTHON (.ci/run makes one); run with `cargo test -- --ignored`"]
async fn the_stripe_charge_recipe_recovers_a_timed_out_charge_through_the_search_lookup() {
    let py = python();
    let up = FakeUpstream::start().await;
    let charge =
        r#"{"id":"ch_recipe","object":"charge","amount":4200,"currency":"eur","metadata":{}}"#;
    // Answered after the proxy's (scaled) 3 s timeout.
    up.push(Behavior::Delay(
        Duration::from_millis(3_500),
        Box::new(Behavior::json(200, charge)),
    ));
    up.on(
        "/v1/charges/search",
        Behavior::json(
            200,
            &format!(r#"{{"object":"search_result","url":"/v1/charges/search","has_more":false,"data":[{charge}]}}"#),
        ),
    );
    // The example config's Stripe upstream and charge route, at a tenth of the time scale.
    let example =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config.example.toml"))
            .unwrap();
    let lookup = example
        .lines()
        .find(|l| l.trim_start().starts_with("lookup = ") && l.contains("charges/search"))
        .unwrap()
        .trim();
    let extra = format!(
        "[[upstreams]]\nname = \"stripe\"\nprefix = \"/stripe\"\nurl = \"{}\"\n{STRIPE_UPSTREAM}\n\
         [[upstreams.routes]]\nmethods = [\"POST\"]\npath = \"/v1/charges\"\nclass = \"write\"\n\
         stamp = \"metadata[oncegate_key]\"\n{lookup}",
        up.url()
    );
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    let code = support::recipe("stripe-charge");
    assert!(code.contains(STRIPE_SCALE.0));
    let code = code.replace(STRIPE_SCALE.0, STRIPE_SCALE.1);
    let stdout = run_python(py, code, &proxy, "the recipe").await;
    assert!(stdout.contains("created ch_recipe"), "{stdout}");
    assert_eq!(up.count_method("POST"), 1, "one charge");
    let searched: Vec<_> = up
        .received()
        .into_iter()
        .filter(|r| r.method == "GET")
        .collect();
    assert!(!searched.is_empty(), "the lookup asked Stripe's search");
    // The search looks for the key that was stamped into the charge's metadata.
    let post = up
        .received()
        .into_iter()
        .find(|r| r.method == "POST")
        .unwrap();
    let key = post.header("idempotency-key").unwrap().to_string();
    assert!(String::from_utf8_lossy(&post.body).contains(&key));
}

/// What an SDK user sees when oncegate answers `outcome-unknown`: the problem's own words (its
/// `error` member), not "Invalid response object" or a bare status; and the SDK does not retry
/// it on its own (`Stripe-Should-Retry` / `x-should-retry`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Python with the stripe and openai SDKs: ONCEGATE_PYTHON (.ci/run makes one); run with `cargo test -- --ignored`"]
async fn sdk_users_read_the_outcome_unknown_problem_in_their_sdks_words() {
    let py = python();
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::Hang);
    let extra = format!(
        "timeout = \"300ms\"\n[[upstreams]]\nname = \"stripe\"\nprefix = \"/stripe\"\nurl = \"{0}\"\ntimeout = \"300ms\"\n[[upstreams]]\nname = \"openai\"\nprefix = \"/openai\"\nurl = \"{0}\"\ntimeout = \"300ms\"",
        up.url()
    );
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    let code = r#"
import os, stripe, openai
base = os.environ["ONCEGATE_URL"]
client = stripe.StripeClient("sk_test_example", base_addresses={"api": base + "/stripe"},
                             max_network_retries=3, http_client=stripe.RequestsClient(timeout=5))
try:
    client.v1.charges.create(params={"amount": 4200, "currency": "usd", "source": "tok_visa"})
    print("stripe: no error")
except stripe.StripeError as e:
    print("stripe:", type(e).__name__, "|", e.user_message, "|", e.code)
oa = openai.OpenAI(api_key="sk-example", base_url=base + "/openai/v1", max_retries=3, timeout=5)
try:
    oa.batches.create(input_file_id="file-abc123", endpoint="/v1/chat/completions", completion_window="24h")
    print("openai: no error")
except openai.APIStatusError as e:
    print("openai:", type(e).__name__, "|", e.message, "|", e.code)
"#;
    let stdout = run_python(py, code.to_string(), &proxy, "the SDK script").await;
    println!("{stdout}");
    for sdk in ["stripe:", "openai:"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(sdk))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(
            line.contains("Outcome unknown: The request POST /v1/")
                && line.contains("may have been applied"),
            "{sdk} shows: {line}"
        );
    }
    // openai-python also carries the problem's code (stripe-python keeps `code` for card errors).
    assert!(stdout.contains("| outcome-unknown"), "{stdout}");
    assert_eq!(
        up.count_method("POST"),
        2,
        "one write per SDK, none retried"
    );
}

/// The agent's own retry, with the real stripe-python: a tool loop calls `charges.create`, gets
/// "outcome unknown" (Stripe accepted the charge, the answer came after the proxy's timeout),
/// and calls `charges.create` again with the same parameters, as every tool loop does after an
/// error. stripe-python draws a new `Idempotency-Key` for every call. One charge, whether the
/// upstream is `per-call` or keeps `stable` keys with only the unsettled-twin guard, with and
/// without task and step headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Python with the stripe and openai SDKs: ONCEGATE_PYTHON (.ci/run makes one); run with `cargo test -- --ignored`"]
async fn a_stripe_tool_loop_that_calls_create_again_after_an_unknown_charges_once() {
    let py = python();
    let charge = r#"{"id":"ch_loop","object":"charge","amount":4200,"currency":"eur"}"#;
    let cases = [
        ("per-call", false, "outcome-unknown"),
        ("per-call", true, "outcome-unknown"),
        ("stable", false, "possible-duplicate"),
        ("stable", true, "outcome-unknown"),
    ];
    for (client_keys, task_step, then) in cases {
        let up = FakeUpstream::start().await;
        // Stripe applies the charge and answers after the proxy's timeout.
        up.push(Behavior::Delay(
            Duration::from_millis(1_500),
            Box::new(Behavior::json(200, charge)),
        ));
        up.set_default(Behavior::json(200, charge));
        let extra = format!(
            "[[upstreams]]\nname = \"stripe\"\nprefix = \"/stripe\"\nurl = \"{}\"\ntimeout = \"700ms\"\nclient_keys = \"{client_keys}\"",
            up.url()
        );
        let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
        let options = if task_step {
            r#"{"headers": {"Oncegate-Task": "order-7", "Oncegate-Step": "charge"}}"#
        } else {
            "{}"
        };
        let code = format!(
            r#"
import os, stripe
client = stripe.StripeClient("sk_test_example",
    base_addresses={{"api": os.environ["ONCEGATE_URL"] + "/stripe"}},
    max_network_retries=5, http_client=stripe.RequestsClient(timeout=10))
for turn in range(3):  # the agent's tool loop: the same call again after every error
    try:
        c = client.v1.charges.create(
            params={{"amount": 4200, "currency": "eur", "source": "tok_visa"}},
            options={options})
        print("turn", turn, "charged", c.id)
    except stripe.StripeError as e:
        body = e.json_body or {{}}
        print("turn", turn, "error", body.get("error", {{}}).get("code"), "|", e.user_message)
"#
        );
        let stdout = run_python(py.clone(), code, &proxy, "the tool loop").await;
        let what = format!("{client_keys}, task/step {task_step}");
        assert_eq!(up.count_method("POST"), 1, "{what}: one charge\n{stdout}");
        assert!(
            stdout.contains("turn 0 error outcome-unknown"),
            "{what}\n{stdout}"
        );
        for turn in [1, 2] {
            assert!(
                stdout.contains(&format!("turn {turn} error {then}")),
                "{what}\n{stdout}"
            );
        }
        // Each of stripe-python's calls drew its own key; the upstream saw none of them but
        // the proxy's one.
        let sent = up.received()[0]
            .header("idempotency-key")
            .unwrap()
            .to_string();
        assert!(
            client_keys == "stable" && !task_step
                || sent.starts_with("fp-")
                || sent.starts_with("ts-"),
            "{what}: upstream saw {sent}"
        );
    }
}
