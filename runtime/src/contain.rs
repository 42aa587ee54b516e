//! Panics of a third-party engine that runs on hostile input, contained: the chat template
//! engine (minijinja) renders a template from the GGUF over messages from the network, and a
//! bug of its own (minijinja 2.24 panicked on `""[::-1]`) must become an error naming what
//! was running — a 400 for that request — not the end of `kiln serve`.
//!
//! Every other panic still ends the process at once: [`install_abort_hook`] (called first thing
//! by the `kiln` binary) aborts on a panic outside [`contain`], as the release profile's
//! `panic = "abort"` did before it became `"unwind"` for this. A panic in the engine thread
//! or a kernel worker must not leave a server that accepts requests nobody will answer.

use anyhow::{anyhow, Result};
use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    /// How many [`contain`] calls this thread is inside.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Where the contained panic happened and what it said, from the hook.
    static LAST: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Abort on any panic outside [`contain`] (after the usual message); inside it, keep the
/// panic's message and place for the error and print nothing. Installed once by the binary
/// (a library does not take over its host's hook); idempotent.
pub fn install_abort_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if DEPTH.with(Cell::get) > 0 {
                let place = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                LAST.with(|l| {
                    *l.borrow_mut() = Some(format!("{}{place}", payload(info.payload())))
                });
                return;
            }
            previous(info);
            std::process::abort();
        }));
    });
}

fn payload(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Run `f`; a panic in it is an error "`what` panicked: message at file:line". `f` must leave
/// nothing shared half-updated when it unwinds (the renderer owns everything it touches).
pub fn contain<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    DEPTH.with(|d| d.set(d.get() + 1));
    LAST.with(|l| l.borrow_mut().take());
    let r = catch_unwind(AssertUnwindSafe(f));
    DEPTH.with(|d| d.set(d.get() - 1));
    r.map_err(|p| {
        let said = LAST
            .with(|l| l.borrow_mut().take())
            .unwrap_or_else(|| payload(p.as_ref()));
        anyhow!("{what} panicked (a bug of the engine, contained): {said}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic inside is an error with its message; the thread goes on; a nested call works; a
    /// value comes through. (Without the hook here: it would abort this test binary on the
    /// panics other tests expect. The child below runs with it.)
    #[test]
    fn a_panic_inside_is_an_error_naming_it() {
        let e = contain("the template", || -> u32 {
            let v: Vec<u8> = Vec::new();
            let i = v.len();
            v[i] as u32
        })
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("the template panicked"), "{e}");
        assert!(e.contains("index out of bounds"), "{e}");
        assert_eq!(
            contain("outer", || contain("inner", || 7).unwrap()).unwrap(),
            7
        );
        let e = contain("outer", || {
            contain("inner", || panic!("deep")).unwrap_err().to_string()
        });
        assert!(e.unwrap().contains("inner panicked"));
    }

    /// With the hook, as in `kiln`: a contained panic is an error naming its place, and a panic
    /// outside `contain` (here in a worker thread) ends the process with SIGABRT. Run in a child
    /// of this test binary.
    // On the host only, as `gguf::fault`'s child test: under qemu-user the child would be
    // exec'd through binfmt_misc without the aarch64 sysroot and never start.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn with_the_hook_a_panic_outside_aborts_the_process() {
        if std::env::var_os("KILN_CONTAIN_CHILD").is_some() {
            install_abort_hook();
            let e = contain("the template", || panic!("inside")).unwrap_err();
            println!("contained: {e}");
            let t = std::thread::spawn(|| panic!("uncontained in a worker"));
            let _ = t.join();
            // Not reached: the hook aborted in the worker.
            std::process::exit(0);
        }
        let exe = std::env::current_exe().expect("the test binary");
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "contain::tests::with_the_hook_a_panic_outside_aborts_the_process",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env("KILN_CONTAIN_CHILD", "1")
            .output()
            .expect("runs the child");
        let err = String::from_utf8_lossy(&out.stderr);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            said.contains("contained: the template panicked") && said.contains("contain.rs:"),
            "{said}"
        );
        assert!(!err.contains("inside"), "a contained panic printed: {err}");
        assert!(!out.status.success(), "the child exited 0: {err}");
        assert!(err.contains("uncontained in a worker"), "{err}");
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                out.status.signal(),
                Some(6),
                "not SIGABRT: {:?}",
                out.status
            );
        }
    }
}
