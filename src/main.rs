//! The `oncegate` binary: parse the command line, load the config (exit 64 when it is bad),
//! bind, and hand over to [`oncegate::run`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use oncegate::config::Config;
use oncegate::route::Class;

/// Exit code for a configuration error (EX_USAGE / EX_CONFIG family).
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
    /// Config file (when no subcommand is given).
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("oncegate: config {}: {e}", cli.config.display());
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match cli.command.unwrap_or(Command::Run) {
        Command::Check => {
            print!("{}", routing_table(&config));
            ExitCode::SUCCESS
        }
        Command::Run => run(config),
    }
}

fn routing_table(c: &Config) -> String {
    let mut out = String::new();
    for u in &c.upstreams {
        out.push_str(&format!("{}  {}  →  {}\n", u.name, u.prefix, u.url));
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
        }
        out.push_str("    (otherwise)      GET/HEAD/OPTIONS/TRACE read, other methods write\n");
    }
    out
}

fn run(config: Config) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("oncegate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let options = match oncegate::store_options(&config) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("oncegate: config: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
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
        let listeners = oncegate::Listeners { proxy };
        match oncegate::run(config, listeners, store, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
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
