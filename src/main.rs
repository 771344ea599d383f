//! The `oncegate` binary: parse the command line, load the config (exit 64 when it is bad),
//! bind, and hand over to [`oncegate::run`]; or run one of the operator commands.

/// jemalloc returns freed memory to the system; glibc's malloc kept half the proxy's RSS as free
/// arenas under the store's allocation pattern (docs/decisions.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use oncegate::cli::{self, AdminClient, ListArgs};
use oncegate::config::Config;
use oncegate::metrics::Metrics;
use oncegate::route::Class;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Exit code for a configuration error (EX_USAGE).
const EXIT_CONFIG: u8 = 64;
/// Exit code when the store cannot be opened (EX_IOERR).
const EXIT_STORE: u8 = 74;

#[derive(Parser)]
#[command(
    name = "oncegate",
    version,
    about = "Makes AI agents' outbound writes happen at most once."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Config file: what `run` and `check` read, and where `actions` and `log` find the admin
    /// API, its token's variable and the log's key.
    #[arg(
        long,
        short,
        env = "ONCEGATE_CONFIG",
        default_value = "oncegate.toml",
        global = true
    )]
    config: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy (the default).
    Run,
    /// Validate the config and print the routing table.
    Check,
    /// Run the guide's scenario on loopback, narrated: a charge that times out after it was
    /// accepted, the retry that does not charge twice, the lookup that settles it.
    Demo,
    /// Find, inspect and settle actions through the admin API.
    Actions {
        #[command(flatten)]
        admin: AdminArgs,
        #[command(subcommand)]
        command: ActionsCommand,
    },
    /// Export and verify the write log.
    Log {
        #[command(flatten)]
        admin: AdminArgs,
        #[command(subcommand)]
        command: LogCommand,
    },
}

#[derive(Args)]
struct AdminArgs {
    /// The admin API's address; default: `admin.listen` of --config, else
    /// http://127.0.0.1:8081. The token comes from the variable `admin.token_env` of --config
    /// names, else ONCEGATE_ADMIN_TOKEN.
    #[arg(long, env = "ONCEGATE_ADMIN", global = true)]
    admin: Option<String>,
}

/// Where the operator commands find the admin API and its token: `--admin`, else the config's
/// `[admin]` (read alone, so that a config whose other secrets are not in this shell still
/// serves), else the defaults.
fn admin_client(admin: AdminArgs, config: &std::path::Path) -> AdminClient {
    let table: Option<toml::Table> = std::fs::read_to_string(config)
        .ok()
        .and_then(|t| t.parse().ok());
    let section = table.as_ref().and_then(|t| t.get("admin")?.as_table());
    let field = |k: &str| section.and_then(|a| a.get(k)?.as_str().map(str::to_string));
    let base = admin.admin.unwrap_or_else(|| {
        let listen = field("listen").unwrap_or_else(|| "127.0.0.1:8081".into());
        // A listener on every interface is reached on loopback from here.
        let listen = listen
            .replace("0.0.0.0:", "127.0.0.1:")
            .replace("[::]:", "[::1]:");
        format!("http://{listen}")
    });
    let token_env = field("token_env").unwrap_or_else(|| "ONCEGATE_ADMIN_TOKEN".into());
    AdminClient {
        base,
        token: std::env::var(&token_env).ok().filter(|t| !t.is_empty()),
        token_env,
    }
}

#[derive(Subcommand)]
enum ActionsCommand {
    /// List actions, newest first.
    List {
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        upstream: Option<String>,
        #[arg(long)]
        task: Option<String>,
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Show one action with its evidence.
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Settle an unknown action by hand.
    Resolve {
        id: String,
        /// `applied` or `not-applied`.
        #[arg(long)]
        outcome: String,
        /// Why (kept in the write log).
        #[arg(long)]
        reason: String,
        #[arg(long)]
        external_id: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Run the status lookup of an unknown action now.
    Lookup {
        id: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum LogCommand {
    /// Print the write log as NDJSON.
    Export {
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Write to this file instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Append the entries after the last one archived in --dir to a new file there (the chain
    /// continues across the files; `log verify --file DIR` checks them as one).
    Archive {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Verify the chain: the live log through the admin API, or an export (a file, or an
    /// archive's folder) with --file.
    Verify {
        #[arg(long)]
        file: Option<PathBuf>,
        /// Environment variable holding the HMAC key the log was written with.
        #[arg(long)]
        hmac_key_env: Option<String>,
        /// `SEQ:HASH` of a head recorded earlier; the export must still contain it.
        #[arg(long)]
        expect_head: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo narrates on stdout; its proxy only speaks up for trouble.
    let default_filter = match cli.command {
        Some(Command::Demo) => "warn",
        _ => "info",
    };
    // `run` sets its logging up once its config is read: spans may go to a collector too.
    if !matches!(cli.command, None | Some(Command::Run)) {
        tracing_subscriber::registry()
            .with(log_layer(default_filter))
            .init();
    }
    match cli.command.unwrap_or(Command::Run) {
        Command::Check => match load(&cli.config) {
            Ok(config) => {
                if let Err(e) = oncegate::check_environment(&config) {
                    eprintln!("oncegate: config: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
                print!("{}", routing_table(&config));
                for c in config.cautions() {
                    println!("caution: {c}");
                }
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Run => match load(&cli.config) {
            Ok(config) => run(config),
            Err(code) => code,
        },
        Command::Demo => demo(),
        Command::Actions { admin, command } => {
            operate(admin_client(admin, &cli.config), |c| async move {
                match command {
                    ActionsCommand::List {
                        state,
                        upstream,
                        task,
                        limit,
                        json,
                    } => {
                        let args = ListArgs {
                            state,
                            upstream,
                            task,
                            limit,
                        };
                        cli::actions_list(&c, &args, json).await.map(|s| (true, s))
                    }
                    ActionsCommand::Show { id, json } => {
                        cli::actions_show(&c, &id, json).await.map(|s| (true, s))
                    }
                    ActionsCommand::Resolve {
                        id,
                        outcome,
                        reason,
                        external_id,
                        json,
                    } => cli::actions_resolve(
                        &c,
                        &id,
                        &outcome,
                        &reason,
                        external_id.as_deref(),
                        json,
                    )
                    .await
                    .map(|s| (true, s)),
                    ActionsCommand::Lookup { id, json } => {
                        cli::actions_lookup(&c, &id, json).await.map(|s| (true, s))
                    }
                }
            })
        }
        Command::Log { admin, command } => {
            let config = cli.config.clone();
            operate(admin_client(admin, &cli.config), |c| async move {
                match command {
                    LogCommand::Export { after, out } => {
                        let text = cli::log_export(&c, after).await?;
                        match out {
                            None => Ok((true, text)),
                            Some(path) => std::fs::write(&path, text)
                                .map(|()| (true, String::new()))
                                .map_err(|e| format!("{}: {e}", path.display())),
                        }
                    }
                    LogCommand::Verify {
                        file: Some(file),
                        hmac_key_env,
                        expect_head,
                    } => {
                        // The key: the one named here, else the one the config names (the
                        // key the log was written with).
                        let (var, from) = match hmac_key_env {
                            Some(var) => (Some(var), "--hmac-key-env".to_string()),
                            None => (
                                configured_hmac_key_env(&config),
                                format!("{}: log.hmac_key_env", config.display()),
                            ),
                        };
                        let key = match var {
                            None => None,
                            Some(var) => Some(
                                std::env::var(&var)
                                    .map_err(|_| {
                                        format!("{from} names {var}, which is not set: the log was written with that key, and verifies only with it")
                                    })?
                                    .into_bytes(),
                            ),
                        };
                        cli::log_verify_file(&file, key, expect_head.as_deref())
                    }
                    LogCommand::Archive { dir } => oncegate::archive::archive(&c, &dir).await,
                    LogCommand::Verify { file: None, .. } => cli::log_verify_remote(&c).await,
                }
            })
        }
    }
}

/// The `log.hmac_key_env` of the config file, if it exists and names one.
fn configured_hmac_key_env(config: &std::path::Path) -> Option<String> {
    let table: toml::Table = std::fs::read_to_string(config).ok()?.parse().ok()?;
    Some(table.get("log")?.get("hmac_key_env")?.as_str()?.to_string())
}

/// The tokio runtime: multi-threaded for the proxy, one thread for an operator command.
fn runtime(multi_thread: bool) -> Result<tokio::runtime::Runtime, ExitCode> {
    let mut b = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    b.enable_all().build().map_err(|e| {
        eprintln!("oncegate: cannot start the runtime: {e}");
        ExitCode::FAILURE
    })
}

fn demo() -> ExitCode {
    let rt = match runtime(true) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let color = std::io::IsTerminal::is_terminal(&std::io::stdout());
    match rt.block_on(oncegate::demo::run(color)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oncegate demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("oncegate: config {}: {e}", path.display());
        ExitCode::from(EXIT_CONFIG)
    })
}

/// Runs an operator command: prints its text; exit 1 when it failed or found a problem.
fn operate<F, Fut>(client: AdminClient, f: F) -> ExitCode
where
    F: FnOnce(AdminClient) -> Fut,
    Fut: std::future::Future<Output = Result<(bool, String), String>>,
{
    let rt = match runtime(false) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(f(client)) {
        Ok((good, text)) => {
            print!("{text}");
            if good {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("oncegate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The effective policy of a route (or of an upstream's other requests), on one line.
fn policy_line(p: &oncegate::config::Policy) -> String {
    let d = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let mut parts = vec![
        format!("timeout {}", d(p.timeout)),
        format!("retries {}", p.retries),
        format!("attempts {}", p.max_attempts),
        format!(
            "key {}",
            if p.require_key {
                "required"
            } else {
                "optional"
            }
        ),
        format!("retention {}", d(p.retention)),
    ];
    // SPEC §4.1: how an agent's repeated call is recognised.
    if p.client_keys == oncegate::config::ClientKeys::PerCall {
        parts.push("client keys per-call".to_string());
    }
    if let Some(w) = p.fingerprint_window {
        parts.push(format!("fingerprint window {}", d(w)));
    }
    if p.key_scope != oncegate::config::KeyScope::Arguments {
        parts.push(format!("key scope {}", p.key_scope.as_str()));
    }
    parts.push(
        if p.twin_guard {
            "twin guard on"
        } else {
            "twin guard off"
        }
        .to_string(),
    );
    if let Some(l) = &p.lookup {
        parts.push(format!(
            "lookup {} {} (absent after {})",
            l.method,
            l.path,
            d(l.absent_after.0)
        ));
    }
    if let Some(at) = &p.stamp {
        parts.push(format!("stamp {at}"));
    }
    parts.join(" · ")
}

fn routing_table(c: &Config) -> String {
    let mut out = String::new();
    for u in &c.upstreams {
        out.push_str(&format!("{}  {}  →  {}\n", u.name, u.prefix, u.url));
        if let oncegate::config::Protocol::Mcp(rules) = &u.protocol {
            out.push_str("    MCP: only tools/call can be a write; other messages are reads\n");
            for t in &rules.tools {
                out.push_str(&format!(
                    "    tool {:<27} {}\n",
                    t.name.as_str(),
                    t.class.as_str()
                ));
                if t.class == Class::Write {
                    out.push_str(&format!("        {}\n", policy_line(&t.policy)));
                }
            }
            let otherwise = if rules.trust_annotations {
                "read if the server's tools/list marks it readOnlyHint, else write"
            } else {
                "write (annotations untrusted)"
            };
            out.push_str(&format!("    tool {:<27} {otherwise}\n", "(otherwise)"));
            out.push_str(&format!("        {}\n", policy_line(&u.policy)));
            continue;
        }
        for r in &u.routes {
            let methods = if r.methods.is_empty() {
                "*".to_string()
            } else {
                r.methods
                    .iter()
                    .map(|m| m.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let class = r.class.map_or("by method", Class::as_str);
            out.push_str(&format!(
                "    {methods:<16} {:<32} {class}\n",
                r.path.as_str()
            ));
            if !matches!(r.class, Some(Class::Read | Class::Deny)) {
                out.push_str(&format!("        {}\n", policy_line(&r.policy)));
            }
        }
        out.push_str("    (otherwise)      GET/HEAD/OPTIONS/TRACE read, other methods write\n");
        out.push_str(&format!("        {}\n", policy_line(&u.policy)));
    }
    out
}

/// Log lines on standard error, filtered by `RUST_LOG` (default: `default_filter`).
fn log_layer<S>(default_filter: &str) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
}

fn run(config: Config) -> ExitCode {
    let rt = match runtime(true) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    // Spans to a collector when `[telemetry] otlp_endpoint` is set; its exporter runs on the
    // runtime.
    let telemetry = match &config.telemetry.otlp_endpoint {
        None => {
            tracing_subscriber::registry()
                .with(log_layer("info"))
                .init();
            None
        }
        Some(endpoint) => {
            let _entered = rt.enter();
            match oncegate::telemetry::layer(&config.telemetry, endpoint) {
                Ok((spans, telemetry)) => {
                    tracing_subscriber::registry()
                        .with(log_layer("info"))
                        .with(spans)
                        .init();
                    Some(telemetry)
                }
                Err(e) => {
                    eprintln!("oncegate: config: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            }
        }
    };
    let code = serve(&rt, config);
    if let Some(t) = telemetry {
        let _entered = rt.enter();
        t.shutdown();
    }
    code
}

fn serve(rt: &tokio::runtime::Runtime, config: Config) -> ExitCode {
    let metrics = Arc::new(Metrics::new());
    let options = match oncegate::store_options(&config, &metrics) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("oncegate: config: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let admin_token = std::env::var(&config.admin.token_env)
        .ok()
        .filter(|t| !t.is_empty());
    rt.block_on(async move {
        let store = match oncegate::open_store(&config, options).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("oncegate: {e}");
                return ExitCode::from(EXIT_STORE);
            }
        };
        let proxy = match tokio::net::TcpListener::bind(config.server.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "oncegate: cannot listen on {} (server.listen): {e}",
                    config.server.listen
                );
                return ExitCode::FAILURE;
            }
        };
        let admin = match tokio::net::TcpListener::bind(config.admin.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "oncegate: cannot listen on {} (admin.listen): {e}",
                    config.admin.listen
                );
                return ExitCode::FAILURE;
            }
        };
        let listeners = oncegate::Listeners {
            proxy,
            admin: Some(admin),
        };
        let services = oncegate::Services::new(store, metrics, admin_token);
        match oncegate::run(config, listeners, services, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e @ oncegate::RunError::Config(_)) => {
                eprintln!("oncegate: config: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
            Err(e) => {
                eprintln!("oncegate: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT: shutting down"),
        () = term => tracing::info!("SIGTERM: shutting down"),
    }
}
