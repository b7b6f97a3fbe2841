//! `--dtype` casts over columns: many storages' elements converted in one call, bit for bit as
//! the Python engine's `ckptfix/model/numeric.py` (`cast_float_bytes`) gives them -- which is
//! what torch 2.x's CPU `Tensor.to` gives:
//!
//! * rounding to nearest, ties to even, with subnormals and overflow to infinity; a float64
//!   going to float16/bfloat16 is rounded through float32 first (torch converts through
//!   `float`, so it can round twice);
//! * a NaN keeps its sign and the top bits of its payload, with the quiet bit set (what x86's
//!   conversion instructions do, and numpy with them); except bfloat16 targets, which get a
//!   fixed NaN (`0xFFFF` from float32/float64, `0x7FC0` from float16), and bfloat16 -> float32,
//!   the bare 16-bit shift (no quieting).
//!
//! The input is the elements of many storages end to end (a cast does not care where one
//! storage ends and the next begins), little-endian, or big-endian with `swap` (each element's
//! bytes reversed first, as torch reads a big-endian checkpoint). Nothing here reads a length
//! from the input: the output is `input / source itemsize * target itemsize` bytes.

/// The float formats a cast reads and writes, by the codes Python passes (`ckptfix/native/cast.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Float {
    F16,
    BF16,
    F32,
    F64,
}

impl Float {
    pub fn from_code(code: u32) -> Option<Float> {
        match code {
            0 => Some(Float::F16),
            1 => Some(Float::BF16),
            2 => Some(Float::F32),
            3 => Some(Float::F64),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Float::F16 | Float::BF16 => 2,
            Float::F32 => 4,
            Float::F64 => 8,
        }
    }
}

/// One element as it is read: its value, or for a NaN its bits (needed for the payload rules).
#[derive(Clone, Copy)]
enum Elem {
    F32(u32),
    F64(u64),
}

const F32_QUIET: u32 = 0x0040_0000;
const F64_QUIET: u64 = 0x0008_0000_0000_0000;

fn f32_is_nan(bits: u32) -> bool {
    bits & 0x7FFF_FFFF > 0x7F80_0000
}

fn f64_is_nan(bits: u64) -> bool {
    bits & 0x7FFF_FFFF_FFFF_FFFF > 0x7FF0_0000_0000_0000
}

/// float16 -> float32, exactly; a NaN as numpy widens it (payload shifted up, not quieted here).
fn f16_to_f32(h: u16) -> u32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1F);
    let man = u32::from(h & 0x3FF);
    match exp {
        0 if man == 0 => sign,
        0 => sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits(), // a subnormal: man * 2**-24
        31 => sign | 0x7F80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    }
}

/// float32 -> float16, rounded to nearest even (NaNs are the caller's).
fn f32_to_f16(x: u32) -> u16 {
    let sign = ((x >> 16) & 0x8000) as u16;
    let abs = x & 0x7FFF_FFFF;
    if abs >= 0x4780_0000 {
        return sign | 0x7C00; // >= 2**16 (or infinity): past the largest float16
    }
    if abs >= 0x3880_0000 {
        // a normal float16 (>= 2**-14): drop 13 mantissa bits; a carry may reach infinity
        let base = (((abs >> 23) - 112) << 10) | ((abs & 0x7F_FFFF) >> 13);
        let rem = abs & 0x1FFF;
        let up = rem > 0x1000 || (rem == 0x1000 && base & 1 == 1);
        return sign | (base + u32::from(up)) as u16;
    }
    let exp = abs >> 23;
    if exp == 0 {
        return sign; // a float32 subnormal: far below half the smallest float16 subnormal
    }
    let shift = 126 - exp; // units of 2**-24: (2**23 + man) * 2**(exp - 150) / 2**-24
    if shift > 24 {
        return sign;
    }
    let sig = (abs & 0x7F_FFFF) | 0x80_0000;
    let q = sig >> shift;
    let rem = sig & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let up = rem > half || (rem == half && q & 1 == 1);
    sign | (q + u32::from(up)) as u16
}

/// float32 bits -> bfloat16, as torch rounds it (integer arithmetic; NaNs are the caller's).
fn f32_to_bf16(bits: u32) -> u16 {
    let rounded = ((bits >> 16) & 1).wrapping_add(0x7FFF).wrapping_add(bits);
    (rounded >> 16) as u16
}

fn f64_to_f32(bits: u64) -> u32 {
    if f64_is_nan(bits) {
        // cvtsd2ss: sign, the payload's top 23 bits, quiet
        let sign = ((bits >> 32) & 0x8000_0000) as u32;
        return sign | 0x7F80_0000 | F32_QUIET | ((bits >> 29) & 0x7F_FFFF) as u32;
    }
    (f64::from_bits(bits) as f32).to_bits()
}

fn f32_to_f64(bits: u32) -> u64 {
    if f32_is_nan(bits) {
        // cvtss2sd: sign, the payload shifted up, quiet
        let sign = u64::from(bits & 0x8000_0000) << 32;
        return sign | 0x7FF0_0000_0000_0000 | F64_QUIET | (u64::from(bits & 0x7F_FFFF) << 29);
    }
    f64::from(f32::from_bits(bits)).to_bits()
}

fn read(source: Float, raw: &[u8]) -> Elem {
    match source {
        Float::F16 => Elem::F32(f16_to_f32(u16::from_le_bytes([raw[0], raw[1]]))),
        Float::BF16 => Elem::F32(u32::from(u16::from_le_bytes([raw[0], raw[1]])) << 16),
        Float::F32 => Elem::F32(u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]])),
        Float::F64 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[..8]);
            Elem::F64(u64::from_le_bytes(b))
        }
    }
}

/// One element, `raw` (little-endian) of `source`, cast to `target` into `out`.
fn cast_one(source: Float, target: Float, raw: &[u8], out: &mut [u8]) {
    let elem = read(source, raw);
    match target {
        Float::BF16 => {
            let single = match elem {
                Elem::F32(b) => b,
                Elem::F64(b) => f64_to_f32(b),
            };
            let nan = match elem {
                Elem::F32(b) => f32_is_nan(b),
                Elem::F64(b) => f64_is_nan(b),
            };
            let half = match (nan, source) {
                (true, Float::F16) => 0x7FC0,
                (true, _) => 0xFFFF,
                (false, _) => f32_to_bf16(single),
            };
            out.copy_from_slice(&half.to_le_bytes());
        }
        Float::F16 => {
            let single = match elem {
                Elem::F32(b) => b,
                Elem::F64(b) => f64_to_f32(b),
            };
            let half = if f32_is_nan(single) {
                // sign, quiet bit and the payload's top 9 bits
                (((single >> 16) & 0x8000) | 0x7E00 | ((single >> 13) & 0x3FF)) as u16
            } else {
                f32_to_f16(single)
            };
            out.copy_from_slice(&half.to_le_bytes());
        }
        Float::F32 => {
            let single = match elem {
                Elem::F32(b) if source == Float::BF16 => b, // the bare shift
                Elem::F32(b) if f32_is_nan(b) => b | F32_QUIET,
                Elem::F32(b) => b,
                Elem::F64(b) => f64_to_f32(b),
            };
            out.copy_from_slice(&single.to_le_bytes());
        }
        Float::F64 => {
            let double = match elem {
                Elem::F32(b) if source == Float::F16 && f32_is_nan(b) => {
                    // numpy widens a float16 NaN straight to float64: payload << 42, then quiet
                    let sign = u64::from(b & 0x8000_0000) << 32;
                    sign | 0x7FF0_0000_0000_0000 | F64_QUIET | (u64::from(b & 0x7F_FFFF) << 29)
                }
                Elem::F32(b) => f32_to_f64(b),
                Elem::F64(b) if f64_is_nan(b) => b | F64_QUIET,
                Elem::F64(b) => b,
            };
            out.copy_from_slice(&double.to_le_bytes());
        }
    }
}

/// `input` (elements of `source`, each byte-reversed first with `swap`) cast to `target`.
pub fn cast(input: &[u8], source: Float, target: Float, swap: bool) -> Result<Vec<u8>, String> {
    let (n, m) = (source.size(), target.size());
    if !input.len().is_multiple_of(n) {
        return Err(format!(
            "{} bytes are not whole {n}-byte elements",
            input.len()
        ));
    }
    let count = input.len() / n;
    let size = count
        .checked_mul(m)
        .ok_or_else(|| "cast output too large".to_string())?;
    let mut out = vec![0u8; size];
    let mut elem = [0u8; 8];
    for (raw, dst) in input.chunks_exact(n).zip(out.chunks_exact_mut(m)) {
        let raw = if swap {
            for (k, b) in raw.iter().rev().enumerate() {
                elem[k] = *b;
            }
            &elem[..n]
        } else {
            raw
        };
        if source == target {
            dst.copy_from_slice(raw);
        } else {
            cast_one(source, target, raw, dst);
        }
    }
    Ok(out)
}

/// Cast `len` bytes at `data` from `source` to `target` (codes of [`Float`]); the elements
/// byte-reversed first when `swap` is 1. UNSUPPORTED for an unknown code.
///
/// # Safety
/// `data` is valid for `len` bytes for the call (or `len` is 0); `out` as in [`crate::ffi::guard`].
#[no_mangle]
pub unsafe extern "C" fn ckptfix_cast_floats(
    data: *const u8,
    len: usize,
    source: u32,
    target: u32,
    swap: u32,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller keeps `len` bytes at `data` alive and unchanged for the call.
    let bytes = unsafe { crate::ffi::input(data, len) };
    let body = move || {
        let (Some(s), Some(t)) = (Float::from_code(source), Float::from_code(target)) else {
            return Ok(None);
        };
        cast(bytes, s, t, swap != 0).map(Some)
    };
    // SAFETY: `out` is null or the caller's out-parameter, valid for one write.
    unsafe { crate::ffi::guard(out, body) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_is_nan(bits: u16) -> bool {
        bits & 0x7FFF > 0x7C00
    }

    fn one(source: Float, target: Float, raw: &[u8]) -> Vec<u8> {
        cast(raw, source, target, false).unwrap()
    }

    #[test]
    fn f16_round_trips_through_f32() {
        for h in 0..=u16::MAX {
            if f16_is_nan(h) {
                continue;
            }
            assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#06x}");
        }
    }

    #[test]
    fn f32_to_f16_rounds_to_nearest_even() {
        // 1 + 2**-11 is halfway between 1 and the next float16: ties to even (1.0)
        assert_eq!(f32_to_f16((1.0f32 + 2f32.powi(-11)).to_bits()), 0x3C00);
        // 1 + 3 * 2**-11 is halfway between two: rounds to the even one (1 + 2**-9)
        assert_eq!(
            f32_to_f16((1.0f32 + 3.0 * 2f32.powi(-11)).to_bits()),
            0x3C02
        );
        assert_eq!(f32_to_f16(65504.0f32.to_bits()), 0x7BFF);
        assert_eq!(f32_to_f16(65519.0f32.to_bits()), 0x7BFF);
        assert_eq!(f32_to_f16(65520.0f32.to_bits()), 0x7C00);
        assert_eq!(f32_to_f16((-1e10f32).to_bits()), 0xFC00);
        assert_eq!(f32_to_f16(2f32.powi(-24).to_bits()), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-25).to_bits()), 0x0000); // a tie: to even (zero)
        assert_eq!(f32_to_f16((2f32.powi(-25) * 1.5).to_bits()), 0x0001);
        assert_eq!(f32_to_f16((-0.0f32).to_bits()), 0x8000);
        assert_eq!(
            f32_to_f16((2f32.powi(-14) * (1.0 - 2f32.powi(-12))).to_bits()),
            0x0400
        ); // up to a normal
    }

    #[test]
    fn nans_follow_the_rules() {
        let nan32 = 0xFFC1_2345u32.to_le_bytes();
        assert_eq!(one(Float::F32, Float::BF16, &nan32), vec![0xFF, 0xFF]);
        assert_eq!(
            one(Float::F16, Float::BF16, &0x7D01u16.to_le_bytes()),
            vec![0xC0, 0x7F]
        );
        // bfloat16 -> float32: the bare shift, a signalling NaN stays signalling
        assert_eq!(
            one(Float::BF16, Float::F32, &0x7F81u16.to_le_bytes()),
            0x7F81_0000u32.to_le_bytes().to_vec()
        );
        // float32 signalling NaN -> float16: quiet, sign and top payload bits
        assert_eq!(
            one(Float::F32, Float::F16, &0xFF80_2000u32.to_le_bytes()),
            0xFE01u16.to_le_bytes().to_vec()
        );
        // float16 NaN -> float64: payload << 42, quiet
        assert_eq!(
            one(Float::F16, Float::F64, &0x7C01u16.to_le_bytes()),
            0x7FF8_0400_0000_0000u64.to_le_bytes().to_vec()
        );
    }

    #[test]
    fn swap_reverses_each_element_first() {
        let big = 1.5f32.to_be_bytes();
        assert_eq!(
            cast(&big, Float::F32, Float::F64, true).unwrap(),
            1.5f64.to_le_bytes().to_vec()
        );
        assert_eq!(
            cast(&big, Float::F32, Float::F32, true).unwrap(),
            1.5f32.to_le_bytes().to_vec()
        );
    }

    #[test]
    fn refuses_partial_elements() {
        assert!(cast(&[0, 0, 0], Float::F32, Float::F16, false).is_err());
        assert!(cast(&[], Float::F64, Float::BF16, false)
            .unwrap()
            .is_empty());
    }
}
