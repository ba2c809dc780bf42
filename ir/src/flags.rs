//! Parsers of command-line values that `titanc` and `titan-run` share (plain functions clap
//! calls as `value_parser`): the counts and sizes of unsigned flags, so that `--dim -1` says the
//! value must be at least 1 instead of taking `-1` for an unknown flag. Flags parsed with them
//! also set `allow_negative_numbers`, so clap hands a negative number to the parser.

/// A whole number of at least `min` that fits `T`; the message states the bound.
pub fn parse_count<T: TryFrom<u64>>(s: &str, min: u64) -> Result<T, String> {
    let bound = match min {
        0 => "0 or more".to_string(),
        m => format!("at least {m}"),
    };
    let t = s.trim();
    if let Some(rest) = t.strip_prefix('-')
        && rest.parse::<f64>().is_ok()
    {
        return Err(format!("{t} is negative; the value must be {bound}"));
    }
    let v: u64 = t.parse().map_err(|_| format!("`{s}` is not a whole number; the value must be {bound}"))?;
    if v < min {
        return Err(format!("the value must be {bound}"));
    }
    T::try_from(v).map_err(|_| format!("{v} is too large for this flag"))
}

/// A count that may be 0 (`--warmup-steps`, `--seed`).
pub fn non_negative<T: TryFrom<u64>>(s: &str) -> Result<T, String> {
    parse_count(s, 0)
}

/// A count or size of at least 1 (`--dim`, `--steps`).
pub fn positive<T: TryFrom<u64>>(s: &str) -> Result<T, String> {
    parse_count(s, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_say_their_bound() {
        assert_eq!(positive::<u64>("12"), Ok(12));
        assert_eq!(non_negative::<u64>("0"), Ok(0));
        assert_eq!(positive::<u64>("-1"), Err("-1 is negative; the value must be at least 1".into()));
        assert_eq!(non_negative::<u64>("-1"), Err("-1 is negative; the value must be 0 or more".into()));
        assert_eq!(positive::<u64>("0"), Err("the value must be at least 1".into()));
        assert_eq!(non_negative::<u64>("1.5"), Err("`1.5` is not a whole number; the value must be 0 or more".into()));
        assert_eq!(positive::<u16>("70000"), Err("70000 is too large for this flag".into()));
    }
}
