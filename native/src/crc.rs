//! CRC-32 as zip (and zlib, and torch's miniz) computes it: the IEEE polynomial, bit-reflected,
//! with the running value passed in and out the way `zlib.crc32(data, value)` takes it.
//!
//! Every byte ckptfix copies into a zip record is checksummed: a record copied from a zip input
//! is checked against the CRC its source recorded (a corrupt record must not pass on with its
//! old CRC), and every other record gets its CRC from its bytes. So the CRC runs over the whole
//! checkpoint beside the kernel's copy, and its speed bounds a byte-moving command (issue 26:
//! zlib's 1-3 GB/s here made `strip-module` ~1.9x `cp`).
//!
//! Two implementations, one answer:
//!
//! * [`crc32_table`]: slice-by-16 in safe Rust (16 table lookups per 16 bytes, ~3-5 GB/s):
//!   portable, and the reference the folding version is tested against;
//! * `crc32_clmul` (x86-64 with PCLMULQDQ and SSE4.1, detected at run time): folds 64 bytes per
//!   step with carry-less multiplication (Intel's "Fast CRC Computation for Generic Polynomials
//!   Using PCLMULQDQ Instruction", Gopal et al. 2009; the same scheme as Linux's crc32-pclmul and
//!   zlib-ng), ~10-20 GB/s. It needs `unsafe` for the intrinsics, kept to one function whose
//!   only memory access is an unaligned 16-byte load from a slice that was checked to hold it.
//!
//! [`crc32`] picks one; everything else in the crate calls it.

/// The IEEE 802.3 polynomial, bit-reflected (x^32 + x^26 + ... + 1 with x^0 as the top bit).
const POLY: u32 = 0xEDB8_8320;

/// `TABLES[k][b]`: the CRC register after byte `b` followed by `k` zero bytes (slice-by-16).
static TABLES: [[u32; 256]; 16] = make_tables();

const fn make_tables() -> [[u32; 256]; 16] {
    let mut tables = [[0u32; 256]; 16];
    let mut b = 0;
    while b < 256 {
        let mut crc = b as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ POLY
            } else {
                crc >> 1
            };
            bit += 1;
        }
        tables[0][b] = crc;
        b += 1;
    }
    let mut k = 1;
    while k < 16 {
        let mut b = 0;
        while b < 256 {
            let prev = tables[k - 1][b];
            tables[k][b] = (prev >> 8) ^ tables[0][(prev & 0xFF) as usize];
            b += 1;
        }
        k += 1;
    }
    tables
}

/// The CRC-32 of `data` continuing from `value` (0 to start), as `zlib.crc32(data, value)`.
pub fn crc32(value: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if data.len() >= clmul::MIN_LEN && clmul::available() {
            return clmul::crc32(value, data);
        }
    }
    crc32_table(value, data)
}

/// Slice-by-16: the portable CRC-32, safe Rust, 16 bytes per step.
pub fn crc32_table(value: u32, data: &[u8]) -> u32 {
    let t = &TABLES;
    let mut crc = !value;
    let mut chunks = data.chunks_exact(16);
    for c in &mut chunks {
        let a = crc ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        crc = t[15][(a & 0xFF) as usize]
            ^ t[14][((a >> 8) & 0xFF) as usize]
            ^ t[13][((a >> 16) & 0xFF) as usize]
            ^ t[12][(a >> 24) as usize]
            ^ t[11][c[4] as usize]
            ^ t[10][c[5] as usize]
            ^ t[9][c[6] as usize]
            ^ t[8][c[7] as usize]
            ^ t[7][c[8] as usize]
            ^ t[6][c[9] as usize]
            ^ t[5][c[10] as usize]
            ^ t[4][c[11] as usize]
            ^ t[3][c[12] as usize]
            ^ t[2][c[13] as usize]
            ^ t[1][c[14] as usize]
            ^ t[0][c[15] as usize];
    }
    for &byte in chunks.remainder() {
        crc = (crc >> 8) ^ t[0][((crc ^ byte as u32) & 0xFF) as usize];
    }
    !crc
}

/// The carry-less-multiplication (folding) CRC for x86-64.
#[cfg(target_arch = "x86_64")]
pub mod clmul {
    use std::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_clmulepi64_si128, _mm_cvtsi32_si128, _mm_extract_epi32,
        _mm_loadu_si128, _mm_set_epi32, _mm_set_epi64x, _mm_srli_si128, _mm_xor_si128,
    };

    /// Below this the table version is as fast (the fold's set-up and final reduction cost
    /// about as much as 64 bytes of table lookups) -- and 64 is what the first fold needs.
    pub const MIN_LEN: usize = 64;

    /// `x^n mod P(x)` in the bit-reflected domain, shifted left by one: the folding constants
    /// of Gopal et al. ("[x^n mod P(x) << 32]' << 1"), computed here rather than copied in.
    const fn fold_constant(n: u32) -> i64 {
        let mut v: u32 = 0x8000_0000; // x^0, reflected
        let mut i = 0;
        while i < n {
            v = if v & 1 != 0 {
                (v >> 1) ^ super::POLY
            } else {
                v >> 1
            };
            i += 1;
        }
        (v as i64) << 1
    }

    /// Fold one 128-bit lane forward by 4 x 128 bits (the main loop), or by 128 bits.
    const K1: i64 = fold_constant(4 * 128 + 32);
    const K2: i64 = fold_constant(4 * 128 - 32);
    const K3: i64 = fold_constant(128 + 32);
    const K4: i64 = fold_constant(128 - 32);
    /// 96 -> 64 bits.
    const K5: i64 = fold_constant(64);
    /// Barrett reduction, 64 -> 32 bits: P(x) reflected over 33 bits, and mu = floor(x^64 / P(x))
    /// reflected (checked against a polynomial division in the tests).
    pub const P_REFLECTED: i64 = 0x1_DB71_0641;
    pub const MU_REFLECTED: i64 = 0x1_F701_1641;

    /// Whether this CPU has what [`crc32`] uses (cached by the standard library after the
    /// first check).
    pub fn available() -> bool {
        is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("sse4.1")
    }

    /// The folding CRC. Callers check [`available`] first; `data` must hold at least
    /// [`MIN_LEN`] bytes (shorter input goes to the table version here too).
    pub fn crc32(value: u32, data: &[u8]) -> u32 {
        if data.len() < MIN_LEN || !available() {
            return super::crc32_table(value, data);
        }
        let whole = data.len() - data.len() % 16;
        // SAFETY: the CPU has PCLMULQDQ and SSE4.1 (checked just above), which is all `fold`'s
        // `target_feature` asks for; `fold` reads only within the slice it is given.
        let folded = unsafe { fold(value, &data[..whole]) };
        super::crc32_table(folded, &data[whole..])
    }

    /// The folding loop over `data` (a multiple of 16 bytes, at least 64).
    ///
    /// # Safety
    /// The CPU must support PCLMULQDQ and SSE4.1 (the target features enabled here; calling a
    /// `target_feature` function on a CPU without them is undefined behaviour). The loads
    /// themselves are safe: each reads 16 bytes from a sub-slice checked to hold 16 bytes.
    #[target_feature(enable = "pclmulqdq", enable = "sse2", enable = "sse4.1")]
    unsafe fn fold(value: u32, data: &[u8]) -> u32 {
        debug_assert!(data.len() >= MIN_LEN && data.len().is_multiple_of(16));
        // an unaligned 16-byte load of `block`, which `chunks_exact(16)` made exactly 16 long
        let load = |block: &[u8]| -> __m128i {
            assert!(block.len() == 16);
            // SAFETY: `block` holds 16 readable bytes; `loadu` has no alignment requirement.
            unsafe { _mm_loadu_si128(block.as_ptr().cast::<__m128i>()) }
        };
        let fold128 = |acc: __m128i, next: __m128i, keys: __m128i| -> __m128i {
            let low = _mm_clmulepi64_si128(acc, keys, 0x00);
            let high = _mm_clmulepi64_si128(acc, keys, 0x11);
            _mm_xor_si128(_mm_xor_si128(next, low), high)
        };

        let mut blocks = data.chunks_exact(16);
        let mut next = || load(blocks.next().expect("at least 64 bytes"));
        // four lanes, 64 bytes apart; the running value enters the first one
        let mut x3 = _mm_xor_si128(next(), _mm_cvtsi32_si128(!value as i32));
        let mut x2 = next();
        let mut x1 = next();
        let mut x0 = next();
        let rest = &data[MIN_LEN..];
        let mut quads = rest.chunks_exact(64);
        let k1k2 = _mm_set_epi64x(K2, K1);
        for quad in &mut quads {
            x3 = fold128(x3, load(&quad[0..16]), k1k2);
            x2 = fold128(x2, load(&quad[16..32]), k1k2);
            x1 = fold128(x1, load(&quad[32..48]), k1k2);
            x0 = fold128(x0, load(&quad[48..64]), k1k2);
        }
        // the four lanes into one, then the remaining 16-byte blocks
        let k3k4 = _mm_set_epi64x(K4, K3);
        let mut x = fold128(x3, x2, k3k4);
        x = fold128(x, x1, k3k4);
        x = fold128(x, x0, k3k4);
        for block in quads.remainder().chunks_exact(16) {
            x = fold128(x, load(block), k3k4);
        }
        // 128 -> 96 -> 64 bits
        let low32 = _mm_set_epi32(0, 0, 0, -1);
        x = _mm_xor_si128(_mm_clmulepi64_si128(x, k3k4, 0x10), _mm_srli_si128(x, 8));
        x = _mm_xor_si128(
            _mm_clmulepi64_si128(_mm_and_si128(x, low32), _mm_set_epi64x(0, K5), 0x00),
            _mm_srli_si128(x, 4),
        );
        // Barrett reduction to 32 bits (the reflected variant: the result is the upper half)
        let pu = _mm_set_epi64x(MU_REFLECTED, P_REFLECTED);
        let t1 = _mm_clmulepi64_si128(_mm_and_si128(x, low32), pu, 0x10);
        let t2 = _mm_clmulepi64_si128(_mm_and_si128(t1, low32), pu, 0x00);
        !(_mm_extract_epi32(_mm_xor_si128(x, t2), 1) as u32)
    }
}

/// `ckptfix_crc32(value, data, len, result, out)`: the CRC-32 of `len` bytes at `data`,
/// continuing from `value`, written to `*result`. Python calls it for big buffers (a copied
/// record's bytes, a megabyte at a time); ctypes releases the GIL for the call, so it runs
/// beside the thread that drives the kernel copy.
///
/// # Safety
/// `data` points to `len` readable bytes for the call (or `len` is 0); `result` is valid for
/// one write of a `u32`; `out` is null or valid for one write of an `OutBuf`.
#[no_mangle]
pub unsafe extern "C" fn ckptfix_crc32(
    value: u32,
    data: *const u8,
    len: usize,
    result: *mut u32,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller keeps `len` bytes at `data` alive and unchanged for the call.
    let bytes = unsafe { crate::ffi::input(data, len) };
    let body = move || {
        if result.is_null() {
            return Err("ckptfix_crc32: no place for the result".to_string());
        }
        let crc = crc32(value, bytes);
        // SAFETY: `result` is the caller's out-parameter, non-null, valid for one write.
        unsafe { result.write(crc) };
        Ok(Some(Vec::new()))
    };
    // SAFETY: `out` is null or the caller's out-parameter, valid for one write.
    unsafe { crate::ffi::guard(out, body) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit by bit, straight from the definition: the reference the fast versions answer to.
    fn crc32_bitwise(value: u32, data: &[u8]) -> u32 {
        let mut crc = !value;
        for &byte in data {
            crc ^= byte as u32;
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ POLY
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// A deterministic byte stream (xorshift), so failures reproduce.
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn known_values() {
        // zlib.crc32(b"") == 0, zlib.crc32(b"123456789") == 0xCBF43926 (the check value)
        assert_eq!(crc32(0, b""), 0);
        assert_eq!(crc32(0, b"123456789"), 0xCBF4_3926);
        assert_eq!(
            crc32(0, b"The quick brown fox jumps over the lazy dog"),
            0x414F_A339
        );
        assert_eq!(crc32(0, &[0u8; 4096]), crc32_bitwise(0, &[0u8; 4096]));
        assert_eq!(crc32(0x1234_5678, b""), 0x1234_5678);
    }

    #[test]
    fn table_matches_bitwise() {
        let data = noise(1000, 7);
        for len in [0, 1, 2, 3, 15, 16, 17, 31, 32, 63, 64, 65, 255, 1000] {
            for value in [0, 1, 0xFFFF_FFFF, 0xDEAD_BEEF] {
                assert_eq!(
                    crc32_table(value, &data[..len]),
                    crc32_bitwise(value, &data[..len]),
                    "len {len}"
                );
            }
        }
    }

    #[test]
    fn every_length_and_alignment_agrees() {
        let data = noise(4096 + 64, 11);
        for start in 0..17 {
            for len in (0..=600).chain([1023, 1024, 1025, 4000, 4096]) {
                let slice = &data[start..start + len];
                let want = crc32_table(0, slice);
                assert_eq!(crc32(0, slice), want, "start {start} len {len}");
                assert_eq!(crc32(0xA5A5_5A5A, slice), crc32_table(0xA5A5_5A5A, slice));
            }
        }
    }

    #[test]
    fn running_value_splits_anywhere() {
        let data = noise(10_000, 3);
        let whole = crc32(0, &data);
        for cut in [0, 1, 15, 16, 63, 64, 65, 127, 128, 4095, 5000, 9999, 10_000] {
            assert_eq!(
                crc32(crc32(0, &data[..cut]), &data[cut..]),
                whole,
                "cut {cut}"
            );
        }
    }

    #[test]
    fn big_buffer() {
        let data = noise(3 << 20, 5);
        assert_eq!(crc32(0, &data), crc32_table(0, &data));
        assert_eq!(crc32(0, &data[1..]), crc32_bitwise(0, &data[1..]));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn clmul_direct_when_available() {
        if !clmul::available() {
            return; // a CPU without PCLMULQDQ: `crc32` is the table version, tested above
        }
        let data = noise(5000, 13);
        for len in [
            64, 65, 79, 80, 127, 128, 129, 191, 192, 193, 256, 1000, 4999, 5000,
        ] {
            for value in [0, 0xFFFF_FFFF, 0x0BAD_F00D] {
                assert_eq!(
                    clmul::crc32(value, &data[..len]),
                    crc32_bitwise(value, &data[..len]),
                    "len {len}"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn barrett_constants_are_derived() {
        // P(x) = 0x1_04C1_1DB7 (with x^32); mu = floor(x^64 / P(x)) by long division over GF(2)
        let p: u128 = 0x1_04C1_1DB7;
        let (mut rem, mut quot): (u128, u128) = (1 << 64, 0);
        for bit in (0..=32).rev() {
            if rem & (1 << (bit + 32)) != 0 {
                rem ^= p << bit;
                quot |= 1 << bit;
            }
        }
        let reflect33 =
            |v: u128| (0..33).fold(0i64, |acc, i| acc | ((((v >> i) & 1) as i64) << (32 - i)));
        assert_eq!(reflect33(quot), clmul::MU_REFLECTED);
        assert_eq!(reflect33(p), clmul::P_REFLECTED);
    }

    #[test]
    fn exported_function() {
        let data = noise(300, 9);
        let mut result = 0u32;
        let mut out = crate::ffi::OutBuf::EMPTY;
        // SAFETY: `data` outlives the call; `result` and `out` are locals valid for one write.
        let status = unsafe { ckptfix_crc32(17, data.as_ptr(), data.len(), &mut result, &mut out) };
        assert_eq!(status, crate::ffi::Status::Ok as i32);
        assert_eq!((out.len, result), (0, crc32_bitwise(17, &data)));
        // SAFETY: len 0 with a null pointer is the empty input
        let status =
            unsafe { ckptfix_crc32(5, std::ptr::null(), 0, &mut result, std::ptr::null_mut()) };
        assert_eq!((status, result), (crate::ffi::Status::Ok as i32, 5));
    }
}
