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
