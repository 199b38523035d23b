//! Content digests that tie a saved artefact to what made it: FNV-1a (64-bit) over bytes, as 16
//! hex digits. Used for cache keys (the synthetic world, the warm start) and to check that a
//! policy is evaluated against the frozen denoiser it was trained with. Not cryptographic: it
//! detects a changed file or setting, not a forged one.

/// FNV-1a (64-bit) of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// [`fnv1a`] as 16 lowercase hex digits.
pub fn fnv1a_hex(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_hex(b"a"), "af63dc4c8601ec8c");
    }
}
