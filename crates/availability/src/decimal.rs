//! Exact decimal numbers at the boundary: `0.99`, `99%` and `1e-4` parse to exact rationals, and
//! exact rationals print as decimals that never overstate an availability.
//!
//! Why exact: the paper's tables sit on powers of ten (0.01³ = 10⁻⁶ exactly), where a binary
//! float cannot tell "six nines" from "just under six nines".

use std::fmt;
use std::str::FromStr;

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::{One, Signed, ToPrimitive, Zero};

/// Largest decimal exponent accepted in input (`1e-300` is fine, `1e-100000` is not).
pub const EXPONENT_MAX: u32 = 400;

/// A number as the user wrote it, held exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decimal {
    value: BigRational,
    text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecimalError {
    #[error("not a number: {0:?} (write e.g. 0.99, 99%, 99.99 %, 1e-4)")]
    Malformed(String),
    #[error("exponent too large in {0:?} (at most {EXPONENT_MAX})")]
    ExponentOutOfRange(String),
}

impl Decimal {
    pub fn value(&self) -> &BigRational {
        &self.value
    }

    /// The text the number was parsed from.
    pub fn text(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Decimal {
    type Err = DecimalError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || DecimalError::Malformed(text.to_string());
        let trimmed = text.trim();
        let (body, percent) = match trimmed.strip_suffix('%') {
            Some(body) => (body.trim_end(), true),
            None => (trimmed, false),
        };
        let (negative, body) = match body.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, body.strip_prefix('+').unwrap_or(body)),
        };
        let (mantissa, exponent_text) = match body.find(['e', 'E']) {
            Some(at) => (&body[..at], Some(&body[at + 1..])),
            None => (body, None),
        };
        let (whole, fraction) = match mantissa.split_once('.') {
            Some((whole, fraction)) => (whole, fraction),
            None => (mantissa, ""),
        };
        let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if whole.len() + fraction.len() == 0 || !digits_only(whole) || !digits_only(fraction) {
            return Err(malformed());
        }
        let exponent: i64 = match exponent_text {
            None => 0,
            Some(e) => {
                let unsigned = e.strip_prefix(['+', '-']).unwrap_or(e);
                if unsigned.is_empty() || !digits_only(unsigned) {
                    return Err(malformed());
                }
                // Bounded before parsing so that a long run of digits cannot overflow.
                if unsigned.trim_start_matches('0').len() > 4 {
                    return Err(DecimalError::ExponentOutOfRange(text.to_string()));
                }
                e.parse().map_err(|_| malformed())?
            }
        };
        if exponent.unsigned_abs() > u64::from(EXPONENT_MAX) {
            return Err(DecimalError::ExponentOutOfRange(text.to_string()));
        }
        let digits: String = [whole, fraction].concat();
        let mut numerator: BigInt = digits.parse().map_err(|_| malformed())?;
        if negative {
            numerator = -numerator;
        }
        let fraction_len = i64::try_from(fraction.len()).map_err(|_| malformed())?;
        let scale = exponent - fraction_len - if percent { 2 } else { 0 };
        let value = BigRational::from_integer(numerator) * pow10(scale);
        Ok(Decimal { value, text: trimmed.to_string() })
    }
}

/// 10^exponent, exactly.
pub fn pow10(exponent: i64) -> BigRational {
    let magnitude = u32::try_from(exponent.unsigned_abs()).expect("decimal exponents are bounded");
    let power = BigRational::from_integer(BigInt::from(10u32).pow(magnitude));
    if exponent >= 0 {
        power
    } else {
        power.recip()
    }
}

/// The nearest `f64` (correctly rounded; tiny values may become subnormal or 0).
pub fn to_f64(value: &BigRational) -> f64 {
    value.to_f64().expect("a BigRational always converts to some f64")
}

/// `value` with `fraction_digits` digits after the point, rounded toward zero — an availability
/// shown this way is never more than the truth.
pub fn format_truncated(value: &BigRational, fraction_digits: usize) -> String {
    let negative = value.is_negative();
    let digits = u32::try_from(fraction_digits).expect("a handful of digits");
    let scaled = (value.abs() * BigRational::from_integer(BigInt::from(10u32).pow(digits))).trunc();
    let mut text = scaled.to_integer().to_string();
    if fraction_digits > 0 {
        if text.len() <= fraction_digits {
            text = format!("{}{}", "0".repeat(fraction_digits + 1 - text.len()), text);
        }
        text.insert(text.len() - fraction_digits, '.');
    }
    if negative && scaled.to_integer() != BigInt::zero() {
        text.insert(0, '-');
    }
    text
}

/// A percentage for display: exact when it has at most `fraction_digits_max` digits after the
/// point (trailing zeros dropped), else truncated there and marked with "…".
pub fn format_percent(value: &BigRational, fraction_digits_max: usize) -> String {
    let percent = value * BigRational::from_integer(BigInt::from(100u32));
    for digits in 0..=fraction_digits_max {
        let scale = pow10(i64::try_from(digits).expect("few digits"));
        if (&percent * &scale).is_integer() {
            return format_truncated(&percent, digits);
        }
    }
    format!("{}…", format_truncated(&percent, fraction_digits_max))
}

/// A percentage with exactly `fraction_digits` digits after the point, truncated.
pub fn format_percent_fixed(value: &BigRational, fraction_digits: usize) -> String {
    format_truncated(&(value * BigRational::from_integer(BigInt::from(100u32))), fraction_digits)
}

/// Is `value` strictly between 0 and 1?
pub fn is_open_unit(value: &BigRational) -> bool {
    value.is_positive() && *value < BigRational::one()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(numerator: i64, denominator: i64) -> BigRational {
        BigRational::new(numerator.into(), denominator.into())
    }

    #[test]
    fn parse() {
        #[track_caller]
        fn check(text: &str, expected: Option<BigRational>) {
            let parsed = text.parse::<Decimal>().ok().map(|d| d.value().clone());
            assert_eq!(parsed, expected, "{text:?}");
        }
        check("0.99", Some(ratio(99, 100)));
        check("99%", Some(ratio(99, 100)));
        check("99.99 %", Some(ratio(9999, 10000)));
        check(" .5", Some(ratio(1, 2)));
        check("1.", Some(ratio(1, 1)));
        check("1e-4", Some(ratio(1, 10000)));
        check("2.5E3", Some(ratio(2500, 1)));
        check("+3", Some(ratio(3, 1)));
        check("-0.5", Some(ratio(-1, 2)));
        check("1e+2%", Some(ratio(1, 1)));
        check("", None);
        check("%", None);
        check(".", None);
        check("abc", None);
        check("0.9.9", None);
        check("1e", None);
        check("1e-", None);
        check("0x10", None);
        check("1e99999999999999999999", None);
        check("1e401", None);
        check("nan", None);
    }

    #[test]
    fn truncation_never_rounds_up() {
        #[track_caller]
        fn check(value: BigRational, digits: usize, expected: &str) {
            assert_eq!(format_truncated(&value, digits), expected);
        }
        check(ratio(9_999_999, 10_000_000), 3, "0.999");
        check(ratio(1, 3), 4, "0.3333");
        check(ratio(2, 3), 2, "0.66");
        check(ratio(5, 1), 0, "5");
        check(ratio(1, 1000), 2, "0.00");
        check(ratio(-1, 4), 2, "-0.25");
    }

    #[test]
    fn percent() {
        #[track_caller]
        fn check(value: BigRational, expected: &str) {
            assert_eq!(format_percent(&value, 6), expected);
        }
        check(ratio(99, 100), "99");
        check(ratio(9999, 10000), "99.99");
        check(ratio(1, 3), "33.333333…");
        check(ratio(100, 101), "99.009900…");
    }
}
