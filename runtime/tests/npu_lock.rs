//! One NPU user at a time, between real `kiln` processes on rknn-standin: while `kiln serve`
//! holds the NPU of a device root, a `kiln run` and a second `kiln serve` on the same root exit at
//! once with an error naming the holder's pid and command; a process on another device root is
//! not affected; and once the holder is killed (the kernel drops its `flock`), the next one runs.

mod npu_common;
mod support;

use kiln_runtime::model::fixture;
use npu_common::standin;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `kiln` with the stand-in as librknnrt and `devroot` as the device root.
fn kiln(devroot: &Path) -> Command {
    let mut c = support::kiln_cmd();
    c.env("KILN_RKNN_LIB", standin("KILN_RKNN_STANDIN"))
        .env("KILN_DEVROOT", devroot)
        .env_remove("KILN_RKNN_STANDIN_FAULT");
    c
}

fn run_on(devroot: &Path, model: &Path) -> (Output, Duration) {
    let t = Instant::now();
    let out = kiln(devroot)
        .arg("run")
        .arg(model)
        .args(["--ids", "1,2,3", "-n", "2", "--temp", "0"])
        .output()
        .expect("running kiln run");
    (out, t.elapsed())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn serve(devroot: &Path, model: &Path) -> Child {
    kiln(devroot)
        .arg("serve")
        .arg(model)
        .args(["--port", &free_port().to_string(), "--parallel", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting kiln serve")
}

/// Kills the holder if the test fails before it does.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_second_npu_user_is_refused_by_name_and_the_next_one_runs() {
    let work = tempfile::tempdir().expect("tempdir");
    let model: PathBuf = work.path().join(fixture::FILE_NAME);
    std::fs::write(&model, fixture::gguf().expect("fixture")).expect("writing the fixture");
    let devroot = work.path().join("root");
    let other_root = work.path().join("other-root");
    std::fs::create_dir_all(&devroot).unwrap();
    std::fs::create_dir_all(&other_root).unwrap();
    let lock = devroot.join("run/kiln/npu.lock");

    let mut holder = Reaper(serve(&devroot, &model));
    let pid = holder.0.id();
    // The holder writes its pid into the lock file once it holds the lock.
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(&lock).unwrap_or_default();
        if text.lines().any(|l| l == format!("pid={pid}")) {
            assert!(
                text.contains("cmdline=") && text.contains(" serve "),
                "{text}"
            );
            break;
        }
        if let Some(st) = holder.0.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            holder
                .0
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("kiln serve exited ({st}) before taking the NPU: {err}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "kiln serve (pid {pid}) did not take the NPU lock in 60 s; {} holds {text:?}",
            lock.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A second user on the same root: refused at once, naming the holder.
    let (out, took) = run_on(&devroot, &model);
    let err = stderr(&out);
    eprintln!("kiln run beside kiln serve (pid {pid}): {err}");
    assert!(
        !out.status.success(),
        "kiln run ran beside the holder: {err}"
    );
    assert!(
        err.contains(&format!("the NPU is in use by pid {pid} (")) && err.contains(" serve "),
        "the refusal names the holder's pid and command: {err}"
    );
    assert!(
        err.contains("kiln will not run a second NPU user beside it"),
        "{err}"
    );
    assert!(
        took < Duration::from_secs(10),
        "refused after {took:?}: it must not wait for the lock"
    );

    // A second `kiln serve` exits too, rather than staying up beside the holder.
    let mut second = Reaper(serve(&devroot, &model));
    let t = Instant::now();
    let st = loop {
        if let Some(st) = second.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a second kiln serve on the same NPU is still running after 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    use std::io::Read;
    second
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!st.success(), "{err}");
    assert!(
        err.contains(&format!("the NPU is in use by pid {pid} (")),
        "{err}"
    );

    // Another device root is another NPU: not refused.
    let (out, _) = run_on(&other_root, &model);
    assert!(out.status.success(), "{}", stderr(&out));

    // The holder dies without cleaning up (SIGKILL): the kernel drops its lock, the next user
    // runs, and the stale pid in the file does not stop it.
    holder.0.kill().expect("killing kiln serve");
    holder.0.wait().expect("reaping kiln serve");
    assert!(std::fs::read_to_string(&lock)
        .unwrap()
        .contains(&format!("pid={pid}")));
    let (out, _) = run_on(&devroot, &model);
    assert!(
        out.status.success(),
        "after the holder died: {}",
        stderr(&out)
    );
}
