//! Little-endian fields at a position in a byte slice: what every format here is made of.
//!
//! The caller has checked `at + width <= bytes.len()` (a short slice panics: a bug, caught at the
//! FFI boundary as an internal error, never a wrong value).

/// The `u16` at `at`.
pub fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// The `u32` at `at`.
pub fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The `u64` at `at`.
pub fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}
