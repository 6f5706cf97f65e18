//! Counting and printing check results; the expected hashes.

use core::fmt::{self, Write};

use npukern::Float;

use crate::data::close;

/// `name hex` lines (`#` starts a comment), written by `scripts/cross.sh`
/// with `NPK_BLESS=1` from the host consumer's output.
const EXPECTED: &str = include_str!("../../expected_hashes.txt");

fn expected(name: &str) -> Option<u64> {
    EXPECTED.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        match (w.next(), w.next()) {
            (Some(n), Some(h)) if n == name && !n.starts_with('#') => {
                u64::from_str_radix(h.trim_start_matches("0x"), 16).ok()
            }
            _ => None,
        }
    })
}

/// How many checks passed and failed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    /// Checks that passed.
    pub passed: u32,
    /// Checks that failed.
    pub failed: u32,
}

impl Outcome {
    /// True when something ran and nothing failed.
    pub fn ok(&self) -> bool {
        self.failed == 0 && self.passed > 0
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "checks: {} passed, {} failed", self.passed, self.failed)
    }
}

/// Records checks and prints them.
pub struct Checker<'a> {
    out: &'a mut dyn Write,
    bless: bool,
    outcome: Outcome,
}

impl<'a> Checker<'a> {
    /// A checker printing to `out`.
    pub fn new(out: &'a mut dyn Write, bless: bool) -> Self {
        Checker {
            out,
            bless,
            outcome: Outcome::default(),
        }
    }

    /// Counts one check; prints `ok name` or `FAIL name: why`.
    pub fn check(&mut self, name: &str, ok: bool, why: fmt::Arguments<'_>) -> bool {
        // Output errors cannot change the outcome, which is also the exit status.
        let _ = if ok {
            self.outcome.passed += 1;
            writeln!(self.out, "ok   {name}")
        } else {
            self.outcome.failed += 1;
            writeln!(self.out, "FAIL {name}: {why}")
        };
        ok
    }

    /// Checks `got` against `want` element by element, each within
    /// `tol(index, want)` (NaN matching NaN, infinities exactly); a failure
    /// names the first element out of it.
    pub fn within<T: Float>(
        &mut self,
        what: &str,
        got: &[T],
        want: &[T],
        tol: impl Fn(usize, f64) -> f64,
    ) -> bool {
        let bad = (0..got.len().min(want.len())).find(|&i| {
            let w = want[i].to_f64();
            !close(got[i].to_f64(), w, tol(i, w))
        });
        match bad {
            None => self.check(
                what,
                got.len() == want.len(),
                format_args!("lengths differ"),
            ),
            Some(i) => self.check(
                what,
                false,
                format_args!(
                    "element {i}: {:e}, reference {:e}",
                    got[i].to_f32(),
                    want[i].to_f32()
                ),
            ),
        }
    }

    /// Compares an output's bit hash with the expected one. Prints
    /// `hash name 0x...` (the line `--bless` collects) and the verdict.
    pub fn hash(&mut self, name: &str, got: u64) -> bool {
        let _ = writeln!(self.out, "hash {name} {got:#018x}");
        let want = expected(name);
        if self.bless {
            self.outcome.passed += 1;
            return true;
        }
        match want {
            Some(w) => self.check(
                name,
                w == got,
                format_args!("bits differ: hash {got:#018x}, expected {w:#018x}"),
            ),
            None => self.check(
                name,
                false,
                format_args!("no expected hash (run scripts/cross.sh with NPK_BLESS=1)"),
            ),
        }
    }

    /// The counts so far.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }
}

/// A check's name, formatted on the stack (no allocator); cut at 120 bytes.
pub struct Name {
    buf: [u8; 120],
    len: usize,
}

impl Name {
    /// Formats `args`.
    pub fn new(args: fmt::Arguments<'_>) -> Self {
        let mut n = Name {
            buf: [0; 120],
            len: 0,
        };
        let _ = n.write_fmt(args);
        n
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // Only whole `&str`s are copied in (see write_str), so this is UTF-8.
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("?")
    }
}

impl Write for Name {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        if end > self.buf.len() {
            return Err(fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// `name!("fmt", args)`: a `Name`.
#[macro_export]
macro_rules! name {
    ($($t:tt)*) => { $crate::report::Name::new(format_args!($($t)*)) };
}
