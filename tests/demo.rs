//! `oncegate demo` runs the guide's scenario end to end and exits 0 only when it held.
#![allow(clippy::unwrap_used)]

#[test]
fn the_demo_runs_and_every_expectation_holds() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"))
        .arg("demo")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "504 outcome-unknown",
        "Oncegate-Outcome: replayed · Oncegate-Replay-Source: lookup",
        "the service holds 1 charge(s) and 1 receipt(s)",
        "charge-setup-fee succeeded",
        "id 3 · isError: false · \"email #1 sent to ops@acme.test\" · Oncegate-Outcome: replayed",
        "ok: true",
        "Every expectation held",
    ] {
        assert!(
            text.contains(line),
            "the demo did not say {line:?}:\n{text}"
        );
    }
    assert!(!text.contains('\x1b'), "colour codes when piped");
    assert!(!text.contains('✗'));
    // Quiet on stderr unless something is wrong.
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
