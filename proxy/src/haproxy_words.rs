//! One line of an HAProxy configuration split into words as HAProxy reads it: blanks separate
//! words; `#` starts a comment; a backslash escapes the next character (`\ `, `\#`, `\\`, `\'`,
//! `\"`, and `\r`, `\n`, `\t`, `\xHH`); double quotes (weak) keep blanks and `#` and still expand
//! escapes and environment variables; single quotes (strong) keep everything as written.
//! Environment variables are expanded only within double quotes (HAProxy's rule): `$NAME`,
//! `${NAME}`, `${NAME-default}` (the default when unset) and `${NAME[*]}` (a value of several
//! blank-separated words becomes as many words); a name is letters, digits and `_`, not starting
//! with a digit; an unset variable expands to nothing, and `\$` keeps a dollar.
//!
//! The input is hostile (any file and any environment a traced process has): splitting never
//! fails and never panics; what it cannot read (an unclosed quote, a bad `\x`) is kept as written.
//! Output is bounded by the line's length plus [`MAX_EXPANSION_BYTES`], so a variable repeated on
//! a line cannot make it grow without limit.

use std::collections::HashMap;

/// Most bytes variables may add to one line's words; past it, the rest of the line is dropped.
pub const MAX_EXPANSION_BYTES: usize = 64 * 1024;

/// The environment variables of a process, as read from `/proc/PID/environ`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Environment(HashMap<String, String>);

impl Environment {
    /// From `/proc/PID/environ`: `NAME=value` entries separated by NUL bytes. Entries without `=`,
    /// or not UTF-8, are skipped (HAProxy could not name them either: names are ASCII).
    #[must_use]
    pub fn from_environ(bytes: &[u8]) -> Self {
        let vars = bytes
            .split(|b| *b == 0)
            .filter_map(|entry| std::str::from_utf8(entry).ok())
            .filter_map(|entry| entry.split_once('='))
            .filter(|(name, _)| !name.is_empty())
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        Self(vars)
    }

    #[must_use]
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }
}

impl<const N: usize> From<[(&str, &str); N]> for Environment {
    fn from(vars: [(&str, &str); N]) -> Self {
        Self(vars.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Quote {
    None,
    Single,
    Double,
}

/// The words of one line, comments removed, quotes, escapes and variables resolved.
#[must_use]
pub fn split(line: &str, env: &Environment) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    // A word is open once anything (even an empty quoted string) started it.
    let mut open = false;
    let mut quote = Quote::None;
    // Bytes of the words closed so far, and the most they may reach.
    let mut closed = 0;
    let limit = line.len() + MAX_EXPANSION_BYTES;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Quote::Single, '\'') | (Quote::Double, '"') => quote = Quote::None,
            (Quote::Single, c) => word.push(c),
            (Quote::None, '\'') => (quote, open) = (Quote::Single, true),
            (Quote::None, '"') => (quote, open) = (Quote::Double, true),
            (Quote::None, '#') => break,
            (Quote::None, c) if c == ' ' || c == '\t' => {
                if open {
                    closed += word.len();
                    words.push(std::mem::take(&mut word));
                    open = false;
                }
            }
            (_, '\\') => {
                open = true;
                match chars.next() {
                    Some('r') => word.push('\r'),
                    Some('n') => word.push('\n'),
                    Some('t') => word.push('\t'),
                    Some('x') => {
                        let hex: String = chars.clone().take(2).collect();
                        match u8::from_str_radix(&hex, 16) {
                            Ok(b) if hex.len() == 2 && b.is_ascii() => {
                                word.push(char::from(b));
                                chars.nth(1);
                            }
                            _ => word.push_str("\\x"),
                        }
                    }
                    Some(other) => word.push(other),
                    None => word.push('\\'),
                }
            }
            (Quote::Double, '$') => {
                open = true;
                let room = limit.saturating_sub(closed + word.len());
                closed += expand(&mut chars, env, &mut word, &mut words, room);
            }
            (_, c) => {
                open = true;
                word.push(c);
            }
        }
        if closed + word.len() > limit {
            break;
        }
    }
    if open || !word.is_empty() {
        words.push(word);
    }
    words
}

/// Expands the variable after a `$` (within double quotes) into `word`, at most `room` bytes of
/// it; a `[*]` list closes `word` after each of its values but the last. Returns the bytes of
/// the words it closed.
fn expand(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    env: &Environment,
    word: &mut String,
    words: &mut Vec<String>,
    room: usize,
) -> usize {
    let braced = chars.peek() == Some(&'{');
    if braced {
        chars.next();
    }
    let mut name = String::new();
    while let Some(&c) = chars.peek() {
        let ok = c == '_' || c.is_ascii_alphabetic() || (c.is_ascii_digit() && !name.is_empty());
        if !ok {
            break;
        }
        name.push(c);
        chars.next();
    }
    if name.is_empty() {
        // Not a variable: the dollar (and brace) stay.
        word.push('$');
        if braced {
            word.push('{');
        }
        return 0;
    }
    let (mut default, mut list) = (None, false);
    if braced {
        // `-default`, `[*]`, then the closing brace; anything else: the text stays as written.
        let rest: String = chars.clone().take_while(|c| *c != '}').collect();
        let closed = chars.clone().nth(rest.chars().count()) == Some('}');
        if !closed {
            word.push_str("${");
            word.push_str(&name);
            return 0;
        }
        for _ in 0..=rest.chars().count() {
            chars.next();
        }
        let rest = match rest.strip_suffix("[*]") {
            Some(r) => {
                list = true;
                r
            }
            None => rest.as_str(),
        };
        if let Some(d) = rest.strip_prefix('-') {
            default = Some(d.to_owned());
        }
    }
    let value = env.get(&name).map(str::to_owned).or(default).unwrap_or_default();
    let value = &value[..value.floor_char_boundary(value.len().min(room))];
    let mut closed = 0;
    if list {
        let mut parts = value.split([' ', '\t']).filter(|p| !p.is_empty()).peekable();
        while let Some(part) = parts.next() {
            word.push_str(part);
            if parts.peek().is_some() {
                closed += word.len();
                words.push(std::mem::take(word));
            }
        }
    } else {
        word.push_str(value);
    }
    closed
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn words(line: &str, env: &Environment) -> Vec<String> {
        split(line, env)
    }

    #[test]
    fn quotes_escapes_and_comments() {
        let env = Environment::default();
        assert_eq!(words("bind :80 # comment", &env), ["bind", ":80"]);
        assert_eq!(words(r"log-format %{+Q}o\ %t\ %s", &env), ["log-format", "%{+Q}o %t %s"]);
        assert_eq!(words(r#"log-format "%{+Q}o %t" '%s #x'"#, &env), ["log-format", "%{+Q}o %t", "%s #x"]);
        assert_eq!(words(r#"a "b"'c'\ d"#, &env), ["a", "bc d"]);
        assert_eq!(words(r#"x "" y"#, &env), ["x", "", "y"], "an empty quoted word is a word");
        assert_eq!(words(r"a\#b \x41\t", &env), ["a#b", "A\t"]);
        assert_eq!(words("a 'unclosed b", &env), ["a", "unclosed b"]);
    }

    #[test]
    fn variables_only_within_double_quotes() {
        let env = Environment::from([("FE_PORT", "8080"), ("LIST", "a  b c"), ("EMPTY", "")]);
        assert_eq!(words(r#"bind "127.0.0.1:${FE_PORT}""#, &env), ["bind", "127.0.0.1:8080"]);
        assert_eq!(words(r#"bind "127.0.0.1:$FE_PORT""#, &env), ["bind", "127.0.0.1:8080"]);
        assert_eq!(words("bind 127.0.0.1:${FE_PORT}", &env), ["bind", "127.0.0.1:${FE_PORT}"], "unquoted: literal");
        assert_eq!(words("bind '${FE_PORT}'", &env), ["bind", "${FE_PORT}"], "single quotes: literal");
        assert_eq!(words(r#"x "${UNSET}" "${UNSET-9000}" "${EMPTY-1}""#, &env), ["x", "", "9000", ""]);
        assert_eq!(words(r#"x "${LIST[*]}" y"#, &env), ["x", "a", "b", "c", "y"]);
        assert_eq!(words(r#"x "\$FE_PORT" "$1" "${" "${FE_PORT""#, &env), ["x", "$FE_PORT", "$1", "${", "${FE_PORT"]);
    }

    #[test]
    fn environ_entries_without_equals_or_utf8_are_skipped() {
        let env = Environment::from_environ(b"A=1\0NOEQUALS\0\xff\xfe=2\0B=x=y\0=nameless\0\0");
        assert_eq!(env.get("A"), Some("1"));
        assert_eq!(env.get("B"), Some("x=y"));
        assert_eq!(env.0.len(), 2);
    }

    #[test]
    fn a_huge_value_repeated_stays_bounded() {
        let big = "x".repeat(1 << 20);
        let env = Environment::from([("BIG", big.as_str())]);
        let line = format!("bind {}", r#""$BIG$BIG$BIG""#.repeat(100));
        let total: usize = split(&line, &env).iter().map(String::len).sum();
        assert!(total <= line.len() + MAX_EXPANSION_BYTES + 4, "{total}");
    }

    proptest! {
        #[test]
        fn any_line_and_environment_split_without_panicking(
            line in "[ -~\t\u{80}-\u{10ffff}]{0,80}",
            vars in proptest::collection::vec(("[A-Z_][A-Z0-9_]{0,4}", "[ -~]{0,20}"), 0..4),
            environ in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let env = Environment(vars.into_iter().collect());
            let _ = split(&line, &env);
            let _ = Environment::from_environ(&environ);
        }

        #[test]
        fn plain_words_split_on_blanks(ws in proptest::collection::vec("[a-z0-9:.@/_-]{1,12}", 0..8)) {
            let line = ws.join(" \t ");
            prop_assert_eq!(split(&line, &Environment::default()), ws);
        }
    }
}
