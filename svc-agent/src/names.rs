//! Names from input: checked as the API server checks them (k8s.io/apimachinery's
//! validation), and rendered for terminals and logs without control characters.
//!
//! Hand-written rather than regexes or a crate: each rule is a short loop over ASCII, and no
//! maintained crate carries exactly apimachinery's rules.

use std::borrow::Cow;
use std::fmt;

const DNS_LABEL_MAX: usize = 63;
const DNS_SUBDOMAIN_MAX: usize = 253;
const LABEL_VALUE_MAX: usize = 63;

fn alnum_lower(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, any length.
fn is_label_body(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(&first), Some(&last)) => {
            alnum_lower(first)
                && alnum_lower(last)
                && b.iter().all(|&c| alnum_lower(c) || c == b'-')
        }
        _ => false,
    }
}

/// IsDNS1123Label: namespaces, Service and EndpointSlice port names.
pub fn is_dns1123_label(s: &str) -> bool {
    s.len() <= DNS_LABEL_MAX && is_label_body(s)
}

/// IsDNS1035Label: Service names (they become DNS names, so they start with a letter).
pub fn is_dns1035_label(s: &str) -> bool {
    is_dns1123_label(s) && s.as_bytes()[0].is_ascii_lowercase()
}

/// IsDNS1123Subdomain: EndpointSlice names.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= DNS_SUBDOMAIN_MAX && s.split('.').all(is_label_body)
}

/// IsValidLabelValue: `(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?`, at most 63.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    let edge = |c: &u8| c.is_ascii_alphanumeric();
    s.len() <= LABEL_VALUE_MAX
        && (b.is_empty()
            || (b.first().is_some_and(edge)
                && b.last().is_some_and(edge)
                && b.iter()
                    .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))))
}

/// What a terminal or a log reader would act on rather than show: C0 (newlines and tabs
/// included: a newline in a name would forge a log line), DEL, C1, the line and paragraph
/// separators, and the bidi controls that reorder what follows (U+202E shows "gpj.exe" as
/// "exe.jpg").
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// `s` as it may be printed on a terminal or in a log line: each unsafe character as Rust
/// escapes it (`\n`, `\u{1b}`); everything else, backslashes included, as it is. Borrowed
/// when nothing needs escaping, which is every valid name.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_unsafe(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Displays its string escaped (see [`escape`]), for format arguments and tracing fields.
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_as_the_api_server_checks_them() {
        for ok in ["a", "web", "a-1", "0abc", &"a".repeat(63)] {
            assert!(is_dns1123_label(ok), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a.b",
            "a_b",
            "a/b",
            "a:b",
            "é",
            "a\n",
            &"a".repeat(64),
        ] {
            assert!(!is_dns1123_label(bad), "{bad:?}");
        }
        assert!(is_dns1035_label("web-1"));
        assert!(!is_dns1035_label("1web"));
        for ok in ["web-1", "web.example", "0.a-b.c", &"a".repeat(253)] {
            assert!(is_dns1123_subdomain(ok), "{ok}");
        }
        for bad in ["", "a..b", ".a", "a.", "a.-b", "Web", &"a".repeat(254)] {
            assert!(!is_dns1123_subdomain(bad), "{bad:?}");
        }
        for ok in ["", "web", "Web_1.x", "a-b", &"a".repeat(63)] {
            assert!(is_label_value(ok), "{ok}");
        }
        for bad in ["_a", "a.", "a b", "a/b", "a\u{1b}", &"a".repeat(64)] {
            assert!(!is_label_value(bad), "{bad:?}");
        }
    }

    #[test]
    fn escaping_leaves_no_control_character() {
        assert!(matches!(escape("demo/web:http"), Cow::Borrowed(_)));
        assert_eq!(
            escape("a\u{1b}[2J\nb\tc\u{7f}\u{9b}d\u{202e}e\u{2028}"),
            "a\\u{1b}[2J\\nb\\tc\\u{7f}\\u{9b}d\\u{202e}e\\u{2028}"
        );
        assert_eq!(escape("ünïcode \\ stays"), "ünïcode \\ stays");
        assert_eq!(Escaped("x\ry").to_string(), "x\\ry");
    }
}
