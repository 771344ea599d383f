//! Configuration: every shipped config parses, every invalid fixture fails naming its key, and
//! the binary exits 64 on a bad config.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use oncegate::config::{Config, StoreConfig};

fn files(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no fixtures in {}", dir.display());
    v
}

#[test]
fn the_example_config_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.example.toml");
    let c = Config::load(&path).unwrap();
    assert!(c.upstreams.len() >= 2);
    // The README's first command must work anywhere: a relative store folder.
    match &c.store {
        StoreConfig::Sled { path, .. } => assert!(path.is_relative()),
        other => panic!("example uses {other:?}"),
    }
}

#[test]
fn valid_fixtures_parse() {
    for f in files("tests/config/valid") {
        if let Err(e) = Config::load(&f) {
            panic!("{} should be valid: {e}", f.display());
        }
    }
}

#[test]
fn invalid_fixtures_fail_naming_the_key() {
    for f in files("tests/config/invalid") {
        let text = std::fs::read_to_string(&f).unwrap();
        let expected = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# error: "))
            .unwrap_or_else(|| panic!("{} lacks a '# error: KEY' first line", f.display()));
        match Config::parse(&text) {
            Ok(_) => panic!("{} should be invalid", f.display()),
            Err(e) => assert!(
                e.to_string().contains(expected),
                "{}: error {e:?} does not name {expected:?}",
                f.display()
            ),
        }
    }
}

#[test]
fn a_bad_config_exits_64_and_names_the_key() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/config/invalid/unknown_key.toml");
    for sub in ["check", "run"] {
        let out = Command::new(env!("CARGO_BIN_EXE_oncegate"))
            .args([sub, "--config"])
            .arg(&f)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{sub}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("lisen"));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_oncegate"))
        .args(["check", "--config", "/nonexistent/oncegate.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
}

/// `oncegate check --config FILE`: what it printed, after checking that it succeeded.
fn check(file: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_oncegate"))
        .args(["check", "--config"])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "check failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn check_prints_the_routing_table() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.example.toml");
    let table = check(&f);
    assert!(
        table.contains("payments  /stripe  →  https://api.stripe.com/"),
        "{table}"
    );
    assert!(table.contains("/v1/customers/*"));
    assert!(table
        .lines()
        .any(|l| l.contains("/v1/chat/completions") && l.ends_with("read")));
    assert!(!table.contains("caution:"), "{table}");
    // Each write route's effective policy, under it: the refunds route's own, the charges' lookup.
    let lines: Vec<&str> = table.lines().collect();
    let under = |route: &str| {
        let i = lines.iter().position(|l| l.contains(route)).unwrap();
        lines[i + 1].to_string()
    };
    let refunds = under("/v1/refunds");
    assert!(
        refunds.contains("attempts 2") && refunds.contains("key required"),
        "{table}"
    );
    let charges = under("/v1/charges ");
    assert!(
        charges.contains("lookup GET /v1/charges/search") && charges.contains("absent after 10m"),
        "{table}"
    );
    assert!(charges.contains("timeout 30s") && charges.contains("retention 1day"));
    // How an agent's repeated call is recognised, per write route (SPEC §4.1).
    assert!(
        charges.contains("client keys per-call") && charges.contains("twin guard on"),
        "{table}"
    );
    let openai = lines
        .iter()
        .skip_while(|l| !l.starts_with("openai"))
        .find(|l| l.contains("timeout 2m"))
        .unwrap();
    assert!(
        !openai.contains("per-call") && openai.contains("twin guard on"),
        "{table}"
    );
}

#[test]
fn check_cautions_about_policies_whose_records_can_outgrow_the_embedded_store() {
    // The example, with more attempts per action by default.
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config.example.toml"))
            .unwrap();
    let risky = example.replacen("max_attempts = 5", "max_attempts = 80", 1);
    assert_ne!(risky, example);
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("oncegate.toml");
    std::fs::write(&f, risky).unwrap();
    // A caution is not an error.
    let text = check(&f);
    assert!(
        text.lines()
            .any(|l| l.starts_with("caution: upstreams.payments: ")
                && l.contains("allows 80 attempts")),
        "{text}"
    );
    // Routes that inherit the count are not repeated; the refunds route (2 attempts) is fine.
    assert!(!text.contains("upstreams.payments.routes"), "{text}");
}

#[test]
fn check_lists_an_mcp_upstreams_tool_rules() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/config/valid/mcp.toml");
    let text = check(&f);
    let line = |start: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} in:\n{text}"))
            .to_string()
    };
    assert!(line("tool search*").ends_with("read"), "{text}");
    assert!(line("tool delete_*").ends_with("deny"), "{text}");
    assert!(line("tool charge").ends_with("write"), "{text}");
    // The write's own policy follows it: one attempt, its lookup.
    assert!(text.contains("attempts 1 · key optional"), "{text}");
    assert!(line("tool (otherwise)").contains("readOnlyHint"), "{text}");
}

/// The keys a section accepts, read from the parser's own "expected one of" list.
fn accepted_keys(toml_with_bogus_key: &str) -> Vec<String> {
    let err = Config::parse(toml_with_bogus_key).unwrap_err().to_string();
    let list = err
        .split("expected one of ")
        .nth(1)
        .or_else(|| err.split("expected ").nth(1))
        .unwrap_or_else(|| panic!("no key list in {err}"));
    let list = list.lines().next().unwrap_or_default().replace(" or ", ",");
    list.split(',')
        .map(|k| k.trim().trim_matches('`').trim().to_string())
        .filter(|k| !k.is_empty())
        .collect()
}

#[test]
fn every_config_key_is_in_the_reference() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    let up = "[[upstreams]]\nname='a'\nprefix='/a'\nurl='http://127.0.0.1:1'\n";
    let sections = [
        "bogus_key = 1\n[server]\n".to_string(),
        "[server]\nbogus_key = 1\n".to_string(),
        "[server]\n[admin]\nbogus_key = 1\n".to_string(),
        "[server]\n[store]\nbogus_key = 1\n".to_string(),
        "[server]\n[log]\nbogus_key = 1\n".to_string(),
        "[server]\n[telemetry]\nbogus_key = 1\n".to_string(),
        "[server]\n[defaults]\nbogus_key = 1\n".to_string(),
        format!("[server]\n{up}bogus_key = 1\n"),
        format!("[server]\n{up}[[upstreams.routes]]\nbogus_key = 1\n"),
        format!("[server]\n{up}protocol = 'mcp'\n[[upstreams.tools]]\nname = 'x'\nclass = 'read'\nbogus_key = 1\n"),
        format!("[server]\n{up}lookup = {{ path = '/x', found = '/id', bogus_key = 1 }}\n"),
        "[server]\ntls = { cert = 'a', key = 'b', bogus_key = 1 }\n".to_string(),
    ];
    let mut checked = 0;
    for s in &sections {
        for key in accepted_keys(&format!(
            "{s}{}",
            if s.contains("[[upstreams]]") { "" } else { up }
        )) {
            assert!(
                doc.contains(&format!("`{key}`")),
                "docs/configuration.md does not describe `{key}`"
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "only {checked} keys found");
}

/// The Kubernetes recipe (issue 60): the manifest, `deploy/kubernetes.yaml`, as a cluster would
/// run it against the config it mounts (the recipe's, in docs/recipes.md). The probe looks where
/// the admin listener is (the pod's address, its port); the pod runs as the image's numeric user
/// with a group that can write a fresh volume; the kubelet waits longer than the proxy drains; a
/// rollout stops the old pod before the new one opens the store; every container has an image,
/// the proxy's a pinned one that is not pulled; the ConfigMap and Secret keys are the ones the
/// recipe's commands make.
#[test]
fn the_kubernetes_recipe_runs_as_a_cluster_would() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/recipes.md")).unwrap();
    let marker = "<!-- recipe:kubernetes-config -->";
    let after = &doc[doc.find(marker).expect("the recipe's config") + marker.len()..];
    let start = after.find("```toml\n").unwrap() + "```toml\n".len();
    let toml = &after[start..start + after[start..].find("```").unwrap()];
    let c = Config::parse(toml).unwrap();

    let text = std::fs::read_to_string(root.join("deploy/kubernetes.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment");
    let claim = docs
        .iter()
        .find(|d| d["kind"] == "PersistentVolumeClaim")
        .expect("a volume claim");
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate");
    let pod = &deployment["spec"]["template"]["spec"];
    let security = &pod["securityContext"];
    assert_eq!(security["runAsNonRoot"], true);
    assert_eq!(security["runAsUser"], 10001);
    assert_eq!(security["fsGroup"], 10001);
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace >= c.server.drain_timeout.as_secs() + 10,
        "the kubelet waits {grace} s, the proxy drains for {:?}",
        c.server.drain_timeout
    );
    let containers = pod["containers"].as_sequence().unwrap();
    for container in containers {
        assert!(container["image"].is_string(), "{container:?}");
    }
    let proxy = containers
        .iter()
        .find(|c| c["name"] == "oncegate")
        .expect("the proxy's container");
    let image = proxy["image"].as_str().unwrap();
    assert!(
        !image.ends_with(":latest") && image.contains(':'),
        "{image}"
    );
    assert_eq!(proxy["imagePullPolicy"], "IfNotPresent");
    assert_eq!(proxy["args"][2], "/etc/oncegate/config.toml");
    let probe = &proxy["readinessProbe"]["httpGet"];
    assert_eq!(probe["path"], "/readyz");
    assert_eq!(probe["port"], u64::from(c.admin.listen.port()));
    assert!(
        !c.admin.listen.ip().is_loopback(),
        "the kubelet cannot reach loopback"
    );
    let token = &proxy["env"][0];
    assert_eq!(token["name"], "ONCEGATE_ADMIN_TOKEN");
    assert_eq!(token["valueFrom"]["secretKeyRef"]["key"], "admin-token");
    assert!(doc.contains("--from-literal=admin-token="));
    // The store's folder is on the claimed volume.
    let mounts = proxy["volumeMounts"].as_sequence().unwrap();
    let store_mount = mounts.iter().find(|m| m["name"] == "store").unwrap();
    let oncegate::config::StoreConfig::Sled { path, .. } = &c.store else {
        panic!("the recipe keeps an embedded store");
    };
    let store_path = path.to_str().unwrap();
    assert!(store_path.starts_with(store_mount["mountPath"].as_str().unwrap()));
    let volumes = pod["volumes"].as_sequence().unwrap();
    let store_volume = volumes.iter().find(|v| v["name"] == "store").unwrap();
    assert_eq!(
        store_volume["persistentVolumeClaim"]["claimName"],
        claim["metadata"]["name"]
    );
    let config_volume = volumes.iter().find(|v| v["name"] == "config").unwrap();
    assert_eq!(config_volume["configMap"]["items"][0]["key"], "config.toml");
    assert!(doc.contains("--from-file=config.toml="));
    // The agent reaches the proxy over the pod's loopback, where the proxy listens.
    let agent = containers.iter().find(|c| c["name"] == "agent").unwrap();
    assert_eq!(
        agent["env"][0]["value"],
        format!("http://{}", c.server.listen)
    );
    // The image's user is the pod's, by number (Kubernetes cannot check a name).
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    assert!(dockerfile.lines().any(|l| l == "USER 10001:10001"));
}

/// The README shows `oncegate check` on the example config: it is what the binary prints.
#[test]
fn the_readme_shows_what_check_prints_for_the_example() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let marker = "$ oncegate check --config config.example.toml\n";
    let start = readme
        .find(marker)
        .expect("the README shows check's output")
        + marker.len();
    let shown = &readme[start..start + readme[start..].find("```").unwrap()];
    assert_eq!(shown, check(&root.join("config.example.toml")));
}

/// The recipes' numbers agree with the example config's (the recipe trap of issue 55): the
/// Stripe SDK's whole retry budget must outlast the proxy's `timeout`, else a charge slower than
/// the SDK's tries turns into an SDK exception while the proxy still waits for it. A try that
/// finds the first attempt running waits `in_flight_wait` (bounded by the SDK's own timeout);
/// the SDK's backoff between tries is left out, which only makes the budget smaller.
#[test]
fn the_stripe_recipes_retries_outlast_the_proxys_timeout() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config.example.toml")).unwrap();
    let config = Config::parse(&text).expect("the example config parses");
    let stripe = config
        .upstreams
        .iter()
        .find(|u| u.prefix == "/stripe")
        .expect("the example config has a Stripe upstream");
    let p = &stripe.policy;
    let recipes = std::fs::read_to_string(root.join("docs/recipes.md")).unwrap();
    for name in ["stripe", "stripe-charge"] {
        let marker = format!("<!-- recipe:{name} -->");
        let code = &recipes[recipes.find(&marker).unwrap()..];
        let number = |after: &str| -> f64 {
            let at = code
                .find(after)
                .unwrap_or_else(|| panic!("{name}: no {after}"))
                + after.len();
            let digits: String = code[at..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            digits.parse().unwrap()
        };
        let sdk_timeout = number("RequestsClient(timeout=");
        let retries = number("max_network_retries=");
        let wait = p.in_flight_wait.as_secs_f64().min(sdk_timeout);
        let budget = sdk_timeout + retries * wait;
        assert!(
            budget > p.timeout.as_secs_f64(),
            "{name}: the SDK gives up after {budget} s of tries, before the proxy's {} s timeout",
            p.timeout.as_secs_f64()
        );
        assert!(
            p.in_flight_wait.as_secs_f64() < sdk_timeout,
            "{name}: a try waiting in_flight_wait would time out in the SDK first"
        );
    }
    assert_eq!(p.client_keys, oncegate::config::ClientKeys::PerCall);
}

/// `check` applies every rule `run` does before it opens anything (issue 60 item 8): over a
/// table of configs and environments, `check` exits 64 exactly when `run` refuses to start with
/// 64, and passes exactly when `run` starts (it was 0 for an admin listener off loopback without
/// a token, which `run` refuses).
#[test]
fn check_and_run_agree_on_what_they_refuse() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store").display().to_string();
    let base = |admin: &str, extra_store: &str, extra_log: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"{admin}\"\n[store]\npath = {store:?}\n{extra_store}\n[log]\n{extra_log}\n[[upstreams]]\nname = \"pay\"\nprefix = \"/pay\"\nurl = \"http://127.0.0.1:9\"\n"
        )
    };
    let long = "0123456789abcdef0123";
    type Case = (&'static str, String, Vec<(&'static str, &'static str)>);
    let cases: Vec<Case> = vec![
        (
            "admin on loopback, no token",
            base("127.0.0.1:0", "", ""),
            vec![],
        ),
        (
            "admin off loopback, no token",
            base("0.0.0.0:0", "", ""),
            vec![],
        ),
        (
            "admin off loopback, a short token",
            base("0.0.0.0:0", "", ""),
            vec![("ONCEGATE_ADMIN_TOKEN", "short")],
        ),
        (
            "admin off loopback, a long token",
            base("0.0.0.0:0", "", ""),
            vec![("ONCEGATE_ADMIN_TOKEN", long)],
        ),
        (
            "a log key variable not set",
            base("127.0.0.1:0", "", "hmac_key_env = \"ONCEGATE_T_UNSET\""),
            vec![],
        ),
        (
            "a store key variable not set",
            base("127.0.0.1:0", "encrypt_key_env = \"ONCEGATE_T_UNSET\"", ""),
            vec![],
        ),
        (
            "a store key that is not a key",
            base("127.0.0.1:0", "encrypt_key_env = \"ONCEGATE_T_KEY\"", ""),
            vec![("ONCEGATE_T_KEY", "not-hex")],
        ),
        (
            "a misspelt key",
            base("127.0.0.1:0", "", "").replace("[log]", "[log]\nretension = \"1d\""),
            vec![],
        ),
    ];
    let mut refused = 0;
    for (name, text, env) in cases {
        let file = tmp.path().join("oncegate.toml");
        std::fs::write(&file, text).unwrap();
        let command = |sub: &str| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_oncegate"));
            c.args([sub, "--config"])
                .arg(&file)
                .env_remove("ONCEGATE_ADMIN_TOKEN")
                .envs(env.iter().copied());
            c
        };
        let check = command("check").output().unwrap().status.code();
        // `run`: refused at once, or listening (then stopped).
        let err = tmp.path().join("run.stderr");
        let mut child = command("run")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let run = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code();
            }
            if std::fs::read_to_string(&err).unwrap().contains("addr=") {
                child.kill().unwrap();
                child.wait().unwrap();
                break Some(0);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: run neither started nor stopped"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(check, run, "{name}: check {check:?}, run {run:?}");
        assert!(matches!(check, Some(0 | 64)), "{name}: {check:?}");
        refused += usize::from(check == Some(64));
    }
    assert_eq!(refused, 6);
}
