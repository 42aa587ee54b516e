//! A chat turned into a prompt: the file's `tokenizer.chat_template` (a Jinja template, as
//! Hugging Face and llama.cpp render it) over the conversation, with `bos_token` / `eos_token` as
//! the file's own pieces and `add_generation_prompt`. `kiln chat`, `kiln serve`'s
//! `/v1/chat/completions` and the boot stage's host reference all render through here.

use super::Tokenizer;
use anyhow::{Context, Result};

/// The steps (minijinja's fuel, about one per instruction) a template may take: a fixed part and
/// a part per message. Real templates take a few dozen steps per message; a template in a file
/// that loops for ever, or for 10^10 steps, fails here instead of holding the engine.
const FUEL_BASE: u64 = 200_000;
const FUEL_PER_MESSAGE: u64 = 2_000;
/// A rendered prompt above this is refused (a template that repeats its input without end).
pub const OUTPUT_LIMIT: usize = 8 << 20;

/// Collects the output, failing past [`OUTPUT_LIMIT`] instead of growing without bound.
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + b.len() > OUTPUT_LIMIT {
            return Err(std::io::Error::other(format!(
                "the rendered prompt is over {OUTPUT_LIMIT} bytes"
            )));
        }
        self.0.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Render `template` over `messages`: [`Compiled::new`] then [`Compiled::render`] (the fuzz
/// target and tests; the server compiles once per model).
pub fn render(
    template: &str,
    messages: &[(String, String)],
    bos: &str,
    eos: &str,
) -> Result<String> {
    Compiled::new(template)?.render(messages, bos, eos)
}

/// A chat template parsed and compiled once (when the model loads), rendered per request.
/// Every render runs under its own fuel, the output cap, with panics of the engine contained
/// ([`crate::contain`]) and the namespaces it made emptied afterwards (below).
#[derive(Clone)]
pub struct Compiled {
    env: minijinja::Environment<'static>,
}

thread_local! {
    /// The namespaces `namespace()` made during this thread's render, or None outside one.
    static SPACES: std::cell::RefCell<Option<Vec<minijinja::Value>>> =
        const { std::cell::RefCell::new(None) };
}

impl Compiled {
    pub fn new(template: &str) -> Result<Compiled> {
        let template = template.to_string();
        crate::contain::contain("parsing tokenizer.chat_template", move || {
            Self::compile(template)
        })?
    }

    fn compile(template: String) -> Result<Compiled> {
        let mut env = minijinja::Environment::new();
        // As Hugging Face's `apply_chat_template` (and llama.cpp's template engine) set up
        // Jinja: a newline after a block tag is dropped, and whitespace before one on its line.
        // Templates written for it rely on this (Phi-4-mini's would start its prompt with a
        // newline).
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .context("the chat template syntax")?,
        );
        env.add_template_owned("chat", template)
            .context("tokenizer.chat_template does not parse")?;
        // Hugging Face templates call raise_exception(msg) for conversations they refuse.
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        // Hugging Face's (and llama.cpp's) template environments give templates the date:
        // Llama 3.x's writes "Today Date: " from `strftime_now("%d %b %Y")`.
        env.add_function(
            "strftime_now",
            |fmt: String| -> Result<String, minijinja::Error> {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                strftime(&fmt, now)
            },
        );
        // minijinja's own `namespace`, remembered: a namespace is the one mutable value of a
        // template, so it is the one way to make a reference cycle (`{% set ns.me = ns %}`),
        // which minijinja 3.1 never frees — a hostile template would leak on every request.
        env.add_function(
            "namespace",
            |defaults: Option<minijinja::value::ValueOrKwargs>| {
                let ns = minijinja::functions::namespace(defaults)?;
                SPACES.with(|s| {
                    if let Some(made) = s.borrow_mut().as_mut() {
                        made.push(ns.clone());
                    }
                });
                Ok::<_, minijinja::Error>(ns)
            },
        );
        Ok(Compiled { env })
    }

    pub fn render(&self, messages: &[(String, String)], bos: &str, eos: &str) -> Result<String> {
        let msgs: Vec<_> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        let ctx = minijinja::context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => bos,
            eos_token => eos,
        };
        self.render_context(ctx, messages.len())
    }

    fn render_context(&self, ctx: minijinja::Value, n_messages: usize) -> Result<String> {
        let mut env = self.env.clone();
        env.set_fuel(Some(
            FUEL_BASE.saturating_add(FUEL_PER_MESSAGE.saturating_mul(n_messages as u64)),
        ));
        SPACES.with(|s| *s.borrow_mut() = Some(Vec::new()));
        let rendered = crate::contain::contain("rendering tokenizer.chat_template", || {
            let mut out = Bounded(Vec::new());
            env.get_template("chat")
                .and_then(|t| t.render_captured_to(ctx, &mut out).map(|_| ()))
                .context("rendering tokenizer.chat_template")?;
            String::from_utf8(out.0).context("tokenizer.chat_template rendered invalid UTF-8")
        });
        let made = SPACES.with(|s| s.borrow_mut().take()).unwrap_or_default();
        empty_namespaces(made);
        rendered?
    }
}

/// Break every reference cycle a render made: set each key of each namespace it made to none.
/// A cycle needs a value changed after it was made (otherwise every reference points from a
/// newer value to an older one), and `{% set ns.key = … %}` is the only change a template can
/// make; so emptying the namespaces' keys leaves no cycle. minijinja's namespace type is
/// private and only a template can assign to it, hence a one-line template per key (keys a
/// template could not name cannot have been assigned by one, and are left).
fn empty_namespaces(made: Vec<minijinja::Value>) {
    if made.is_empty() {
        return;
    }
    let env = minijinja::Environment::new();
    let ident = |k: &str| {
        let mut c = k.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
    };
    for ns in made {
        let Ok(keys) = ns.try_iter() else { continue };
        let keys: Vec<String> = keys
            .filter_map(|k| k.as_str().map(str::to_string))
            .filter(|k| ident(k))
            .collect();
        for k in keys {
            let _ = crate::contain::contain("emptying a template namespace", || {
                env.render_str(
                    &format!("{{% set ns.{k} = none %}}"),
                    minijinja::context! { ns => ns.clone() },
                )
            });
        }
    }
}

/// `secs` after the Unix epoch (UTC) formatted as C's `strftime` formats it, for the directives
/// chat templates use (`%d %e %m %y %Y %b %B %a %A %j %H %M %S %%`); any other is an error
/// naming it rather than a date silently left unformatted.
pub fn strftime(fmt: &str, secs: u64) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = secs / 86_400;
    let sod = secs % 86_400;
    let (year, month, day) = crate::civil::civil_from_days(days as i64);
    let yday = days as i64 - crate::civil::days_from_civil(year, 1, 1) + 1;
    let wday = ((days + 4) % 7) as usize; // 1970-01-01 was a Thursday
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let d = chars.next();
        let piece = match d {
            Some('d') => format!("{day:02}"),
            Some('e') => format!("{day:2}"),
            Some('m') => format!("{month:02}"),
            Some('y') => format!("{:02}", year % 100),
            Some('Y') => year.to_string(),
            Some('b') => MONTHS[(month - 1) as usize][..3].to_string(),
            Some('B') => MONTHS[(month - 1) as usize].to_string(),
            Some('a') => DAYS[wday][..3].to_string(),
            Some('A') => DAYS[wday].to_string(),
            Some('j') => format!("{yday:03}"),
            Some('H') => format!("{:02}", sod / 3600),
            Some('M') => format!("{:02}", sod / 60 % 60),
            Some('S') => format!("{:02}", sod % 60),
            Some('%') => "%".to_string(),
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: the directive %{} is not implemented by kiln",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// A tokenizer's chat template with its BOS/EOS pieces.
pub struct Template {
    compiled: Compiled,
    bos: String,
    eos: String,
    /// Whether encoding the prompt adds BOS / EOS itself (the file's `add_bos_token` /
    /// `add_eos_token`).
    add_bos: bool,
    add_eos: bool,
}

impl Template {
    /// The file's template; an error when the file has none.
    pub fn of(tok: &Tokenizer) -> Result<Template> {
        let template = tok
            .chat_template()
            .context("no tokenizer.chat_template in the file")?;
        let compiled = Compiled::new(template)?;
        let piece = |id: Option<u32>| {
            id.map(|t| String::from_utf8_lossy(&tok.token_to_piece(t)).into_owned())
                .unwrap_or_default()
        };
        Ok(Template {
            compiled,
            bos: piece(tok.bos()),
            eos: piece(tok.eos()),
            add_bos: tok.add_bos(),
            add_eos: tok.add_eos(),
        })
    }

    /// `(role, content)` messages as the prompt text (to be encoded with special tokens parsed
    /// and added). As llama.cpp's `common_chat_template_direct_apply`: where encoding adds BOS
    /// itself, a leading BOS piece the template wrote (`{{ bos_token }}`, Gemma, Llama 3) is
    /// dropped, and likewise a trailing EOS piece, so the prompt does not start with two BOS.
    pub fn render(&self, messages: &[(String, String)]) -> Result<String> {
        let mut out = self.compiled.render(messages, &self.bos, &self.eos)?;
        if self.add_bos && !self.bos.is_empty() && out.starts_with(&self.bos) {
            out.drain(..self.bos.len());
        }
        if self.add_eos && !self.eos.is_empty() && out.ends_with(&self.eos) {
            out.truncate(out.len() - self.eos.len());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat() -> Vec<(String, String)> {
        vec![
            ("system".into(), "Be brief.".into()),
            ("user".into(), "Hi".into()),
        ]
    }

    /// A ChatML template (SmolLM2's and Qwen's shape) renders as Hugging Face renders it.
    #[test]
    fn a_real_template_renders() {
        let t = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        assert_eq!(
            render(t, &chat(), "", "").expect("renders"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// Block tags on lines of their own leave no whitespace, as Hugging Face's Jinja setup
    /// (`trim_blocks`, `lstrip_blocks`) renders them: jinja2 3.1 with those options gives
    /// `"[Hi]\n"` for this template, and `"\n  \n[Hi]\n  \n\n  \n"` without them.
    #[test]
    fn block_tags_are_trimmed_as_hugging_face_renders() {
        let t = "{% for m in messages %}\n  {% if m.role == \"user\" %}\n[{{ m.content }}]\n  \
                 {% endif %}\n{% endfor %}\n";
        let msgs = vec![("user".into(), "Hi".into()), ("system".into(), "x".into())];
        assert_eq!(render(t, &msgs, "", "").expect("renders"), "[Hi]\n");
    }

    /// `strftime` against Python's `datetime.strftime` (UTC) at four instants, and an
    /// unimplemented directive refused by name.
    #[test]
    fn strftime_formats_as_python_does() {
        let f = "%d %b %Y|%A %a %B %e %j %H:%M:%S %y %m %%";
        for (secs, want) in [
            (
                1_721_952_000,
                "26 Jul 2024|Friday Fri July 26 208 00:00:00 24 07 %",
            ),
            (
                951_868_799,
                "29 Feb 2000|Tuesday Tue February 29 060 23:59:59 00 02 %",
            ),
            (
                0,
                "01 Jan 1970|Thursday Thu January  1 001 00:00:00 70 01 %",
            ),
            (
                4_102_444_799,
                "31 Dec 2099|Thursday Thu December 31 365 23:59:59 99 12 %",
            ),
        ] {
            assert_eq!(strftime(f, secs).unwrap(), want, "{secs}");
        }
        let e = strftime("%Q", 0).unwrap_err().to_string();
        assert!(e.contains("the directive %Q is not implemented"), "{e}");
        let t = "{{ strftime_now('%Y') | length }}";
        assert_eq!(render(t, &chat(), "", "").unwrap(), "4");
    }

    /// What panicked in minijinja 2.24 (a reversing slice of an empty string or list, found by
    /// the `chat_template` fuzz target), with release's abort ending `kiln serve`: now it
    /// renders; and a panic of the engine would be this request's error ([`crate::contain`]).
    #[test]
    fn reversing_an_empty_string_or_list_renders() {
        let t = "{% for m in messages %}[{{ m.content[::-1] }}]{% endfor %}";
        let msgs = vec![("user".to_string(), String::new())];
        assert_eq!(render(t, &msgs, "", "").expect("renders"), "[]");
        let t = "{% for m in messages[::-1] %}{{ m.role }}{% endfor %}{{ ''[::-1] }}.";
        assert_eq!(render(t, &[], "", "").expect("renders"), ".");
    }

    /// The compiled template is rendered again and again: each render gets its own fuel (a
    /// render that takes most of it succeeds every time) and the same output.
    #[test]
    fn a_compiled_template_renders_again_with_fresh_fuel() {
        let t = "{% for i in range(30000) %}{% endfor %}{{ messages | length }}";
        let c = Compiled::new(t).expect("compiles");
        for _ in 0..4 {
            assert_eq!(c.render(&chat(), "", "").expect("renders"), "2");
        }
    }

    /// A value held only by a namespace that refers to itself (directly, or through another
    /// namespace made with a dict) is freed after the render: minijinja never frees such a
    /// cycle, so a hostile template would leak it on every request.
    #[test]
    fn a_namespace_that_holds_itself_is_freed_after_the_render() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        #[derive(Debug)]
        struct Probe(Arc<AtomicUsize>);
        impl minijinja::value::Object for Probe {}
        impl Drop for Probe {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let cases = [
            "{% set ns = namespace() %}{% set ns.me = ns %}{% set ns.p = probe %}x",
            "{% set a = namespace(n=1) %}{% set b = namespace({'odd key': a}) %}\
             {% set a.back = [b] %}{% set b.p = probe %}x",
        ];
        for t in cases {
            let dropped = Arc::new(AtomicUsize::new(0));
            let c = Compiled::new(t).expect("compiles");
            let ctx = minijinja::context! {
                probe => minijinja::Value::from_object(Probe(dropped.clone())),
            };
            assert_eq!(c.render_context(ctx, 0).expect("renders"), "x", "{t}");
            assert_eq!(dropped.load(Ordering::SeqCst), 1, "leaked by {t}");
        }
    }

    /// Templates a hostile GGUF could carry: each fails with an error, quickly, instead of
    /// hanging the engine or exhausting memory.
    #[test]
    fn a_hostile_template_fails_and_never_hangs() {
        let cases = [
            (
                "a loop of 10^12 steps with no output",
                "{% set ns = namespace(n=0) %}{% for i in range(9999) %}{% for j in range(9999) %}\
                 {% for k in range(9999) %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}\
                 {% endfor %}{{ ns.n }}",
            ),
            (
                "output without end",
                "{% for i in range(1000) %}{{ messages[0]['content'] * 100000 }}{% endfor %}",
            ),
            (
                "recursion without end",
                "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            ),
            ("a raise", "{{ raise_exception('no system role') }}"),
        ];
        let deep = format!("{{{{ {}1{} }}}}", "(".repeat(5000), ")".repeat(5000));
        for (what, t) in cases
            .iter()
            .copied()
            .chain([("nesting 5000 deep", deep.as_str())])
        {
            let t0 = std::time::Instant::now();
            let r = render(t, &chat(), "", "");
            let dt = t0.elapsed();
            assert!(
                r.is_err(),
                "{what}: rendered {} bytes",
                r.map_or(0, |s| s.len())
            );
            assert!(dt.as_secs() < 10, "{what}: took {dt:?}");
        }
    }
}
