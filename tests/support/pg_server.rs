//! A PostgreSQL server of a test's own, which the test may crash and start again: initdb into a
//! temporary folder, `postgres` on a free port of 127.0.0.1 with trust auth. The binaries are
//! the machine's (`pg_config --bindir`, as .ci/run's PostgreSQL provides); as root, the server
//! runs as the `postgres` user (PostgreSQL refuses to run as root).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub struct PgServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    child: Option<Child>,
}

fn root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `program args…`, as the `postgres` user when this process is root.
fn as_owner(program: &Path) -> Command {
    if root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl PgServer {
    /// A new server, started and accepting connections.
    pub fn start() -> PgServer {
        let out = Command::new("pg_config")
            .arg("--bindir")
            .output()
            .expect("pg_config (PostgreSQL's server binaries)");
        let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let dir = tempfile::tempdir().unwrap();
        if root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let data = dir.path().join("data");
        let init = as_owner(&bin.join("initdb"))
            .args(["-U", "postgres", "--auth=trust", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut s = PgServer {
            dir,
            bin,
            port,
            child: None,
        };
        s.up();
        s
    }

    /// The URL of database `postgres` on it.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server (again) and waits until it accepts connections.
    pub fn up(&mut self) {
        let child = as_owner(&self.bin.join("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=200",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false);
            if ready {
                return;
            }
            assert!(Instant::now() < deadline, "PostgreSQL did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server as a crash would: an immediate shutdown (SIGQUIT to the postmaster),
    /// every session cut, no checkpoint; the next start recovers from the write-ahead log.
    pub fn crash(&mut self) {
        let pid = self.dir.path().join("data/postmaster.pid");
        // The postmaster itself (under runuser, the child is runuser).
        if let Some(postmaster) = std::fs::read_to_string(&pid)
            .ok()
            .and_then(|s| s.lines().next().map(str::to_string))
        {
            let _ = Command::new("kill").args(["-QUIT", &postmaster]).status();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while pid.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.crash();
    }
}
