//! A tiny model of the Python values and operators the toy templates use.
//!
//! Ints, bools, strings, lists, insertion-ordered dicts, and floor division and modulo as
//! Python does them, so the generator knows what the correct and the buggy functions
//! return.

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Py {
    Int(i64),
    Bool(bool),
    Str(String),
    List(Vec<Py>),
    /// Insertion-ordered, like a Python dict.
    Dict(Vec<(Py, Py)>),
}

/// A call's result: a value, or the name of the exception it raises.
pub(crate) type Res = Result<Py, &'static str>;

impl Py {
    pub(crate) fn repr(&self) -> String {
        match self {
            Py::Int(i) => i.to_string(),
            Py::Bool(true) => "True".into(),
            Py::Bool(false) => "False".into(),
            // Generated strings never contain quotes or backslashes.
            Py::Str(s) => format!("'{s}'"),
            Py::List(v) => format!(
                "[{}]",
                v.iter().map(Py::repr).collect::<Vec<_>>().join(", ")
            ),
            Py::Dict(kv) => format!(
                "{{{}}}",
                kv.iter()
                    .map(|(k, v)| format!("{}: {}", k.repr(), v.repr()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Python `==` (dicts compare without order).
    pub(crate) fn py_eq(&self, other: &Py) -> bool {
        match (self, other) {
            (Py::Dict(a), Py::Dict(b)) => {
                a.len() == b.len()
                    && a.iter()
                        .all(|(k, v)| b.iter().any(|(k2, v2)| k == k2 && v.py_eq(v2)))
            }
            (Py::List(a), Py::List(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.py_eq(y))
            }
            _ => self == other,
        }
    }

    pub(crate) fn int(&self) -> i64 {
        match self {
            Py::Int(i) => *i,
            _ => unreachable!("template argument is not an int"),
        }
    }

    pub(crate) fn ints(&self) -> Vec<i64> {
        match self {
            Py::List(v) => v.iter().map(Py::int).collect(),
            _ => unreachable!("template argument is not a list"),
        }
    }

    pub(crate) fn list(&self) -> &[Py] {
        match self {
            Py::List(v) => v,
            _ => unreachable!("template argument is not a list"),
        }
    }

    pub(crate) fn text(&self) -> &str {
        match self {
            Py::Str(s) => s,
            _ => unreachable!("template argument is not a str"),
        }
    }
}

pub(crate) fn li(v: impl IntoIterator<Item = i64>) -> Py {
    Py::List(v.into_iter().map(Py::Int).collect())
}

pub(crate) fn st(s: impl Into<String>) -> Py {
    Py::Str(s.into())
}

pub(crate) fn same(a: &Res, b: &Res) -> bool {
    match (a, b) {
        (Ok(x), Ok(y)) => x.py_eq(y),
        (Err(x), Err(y)) => x == y,
        _ => false,
    }
}

pub(crate) fn res_text(r: &Res) -> String {
    match r {
        Ok(v) => format!("returns `{}`", v.repr()),
        Err(e) => format!("raises `{e}`"),
    }
}

/// Python slice bounds `[start:stop]` on a sequence of length `n` (negative indices wrap,
/// out-of-range clamps).
pub(crate) fn slice_bounds(n: usize, start: i64, stop: i64) -> (usize, usize) {
    let n = n as i64;
    let fix = |i: i64| -> i64 {
        if i < 0 {
            (i + n).max(0)
        } else {
            i.min(n)
        }
    };
    let (a, b) = (fix(start), fix(stop));
    (a as usize, b.max(a) as usize)
}

pub(crate) fn floordiv(a: i64, b: i64) -> Result<i64, &'static str> {
    if b == 0 {
        return Err("ZeroDivisionError");
    }
    let q = a / b;
    Ok(if (a % b != 0) && ((a < 0) != (b < 0)) {
        q - 1
    } else {
        q
    })
}

pub(crate) fn pymod(a: i64, b: i64) -> Result<i64, &'static str> {
    Ok(a - b * floordiv(a, b)?)
}
