//! The docs' Python recipes, run against the proxy and a local upstream that stalls the first
//! attempt past the SDK's timeout: each must reach the upstream once. Needs a Python with the
//! SDKs (`ONCEGATE_PYTHON`; `.ci/run` makes one); without it the test says so and skips.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{config, Behavior, FakeUpstream, TestProxy};

/// The Python code block that follows `<!-- recipe:NAME -->` in docs/recipes.md.
fn recipe(name: &str) -> String {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/recipes.md")).unwrap();
    let marker = format!("<!-- recipe:{name} -->");
    let after = &doc[doc.find(&marker).unwrap_or_else(|| panic!("no {marker}")) + marker.len()..];
    let start = after.find("```python\n").unwrap() + "```python\n".len();
    let end = after[start..].find("```").unwrap();
    after[start..start + end].to_string()
}

fn python(test: &str) -> Option<String> {
    match std::env::var("ONCEGATE_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!(
                "skipping {test}: ONCEGATE_PYTHON is not set (a Python with stripe and openai)"
            );
            None
        }
    }
}

async fn run_recipe(name: &str, prefix: &str, first_answer: Behavior, then: Behavior) {
    let Some(py) = python(name) else { return };
    let up = FakeUpstream::start().await;
    // The first attempt is accepted, then answered only after the SDK gave up waiting.
    up.push(Behavior::Delay(
        Duration::from_millis(1600),
        Box::new(first_answer),
    ));
    up.set_default(then);
    let extra = format!(
        "[[upstreams]]\nname = \"sdk\"\nprefix = \"{prefix}\"\nurl = \"{}\"\ntimeout = \"10s\"",
        up.url()
    );
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    let code = recipe(name);
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{name} recipe failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("created"), "{stdout}");
    let posts = up.count_method("POST");
    assert_eq!(
        posts, 1,
        "the {name} SDK's write reached the upstream {posts} times"
    );
    assert!(proxy.admin("GET", "/v1/log/verify", "").await.json()["ok"] == true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_recipe_creates_one_customer_despite_a_stalled_first_attempt() {
    let customer = r#"{"id":"cus_recipe","object":"customer","email":"ops@acme.test"}"#;
    run_recipe(
        "stripe",
        "/stripe",
        Behavior::json(200, customer),
        Behavior::json(200, customer),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_recipe_creates_one_batch_despite_a_stalled_first_attempt() {
    let batch = r#"{"id":"batch_recipe","object":"batch","endpoint":"/v1/chat/completions","input_file_id":"file-abc123","completion_window":"24h","status":"validating","created_at":1700000000}"#;
    run_recipe(
        "openai",
        "/openai",
        Behavior::json(200, batch),
        Behavior::json(200, batch),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_upload_recipe_uploads_one_file_despite_a_stalled_first_attempt() {
    let file = r#"{"id":"file-recipe","object":"file","bytes":72,"created_at":1700000000,"filename":"requests.jsonl","purpose":"batch","status":"processed"}"#;
    run_recipe(
        "openai-files",
        "/openai",
        Behavior::json(200, file),
        Behavior::json(200, file),
    )
    .await;
}

/// What an SDK user sees when oncegate answers `outcome-unknown`: the problem's own words (its
/// `error` member), not "Invalid response object" or a bare status; and the SDK does not retry
/// it on its own (`Stripe-Should-Retry` / `x-should-retry`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_users_read_the_outcome_unknown_problem_in_their_sdks_words() {
    let Some(py) = python("sdk_users_read_the_outcome_unknown_problem") else {
        return;
    };
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
    let base = proxy.url("");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(py)
            .args(["-c", code])
            .env("ONCEGATE_URL", base.trim_end_matches('/'))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    for sdk in ["stripe:", "openai:"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(sdk))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(
            line.contains("Outcome unknown: Do not send this write again"),
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
