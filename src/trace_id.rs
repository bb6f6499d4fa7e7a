//! A trace's id (`meta.trace_id`): 128 random bits as 32 lower-case hex
//! digits, written with the first `meta` rows, so that traces of many
//! processes and machines can be put together (`export --parquet`) and
//! still be told apart.
//!
//! A trace written before the row existed gets one derived from what it
//! says about itself ([`derived`]): the same trace gives the same id at
//! every export.

/// A new id, from the kernel's random source (`getrandom(2)`); should
/// that fail, one derived from the time and memptrace's pid.
pub fn new() -> String {
    let mut bits = [0u8; 16];
    match getrandom::fill(&mut bits) {
        Ok(()) => hex(u128::from_be_bytes(bits)),
        Err(_) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            derived(&[&now.to_string(), &std::process::id().to_string()])
        }
    }
}

/// A stable id from `facts` (each fed whole, with its length, so that
/// `["ab", "c"]` and `["a", "bc"]` differ): 128-bit FNV-1a, not a secret.
pub fn derived(facts: &[&str]) -> String {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;
    let mut hash = OFFSET;
    for fact in facts {
        let len = (fact.len() as u64).to_le_bytes();
        for byte in len.iter().chain(fact.as_bytes()) {
            hash ^= u128::from(*byte);
            hash = hash.wrapping_mul(PRIME);
        }
    }
    hex(hash)
}

fn hex(bits: u128) -> String {
    format!("{bits:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_32_hex_digits_and_new_ones_differ() {
        let (a, b) = (new(), new());
        for id in [&a, &b] {
            assert_eq!(id.len(), 32);
            assert!(
                id.bytes()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
        }
        assert_ne!(a, b);
    }

    #[test]
    fn derived_ids_are_stable_and_bound_facts() {
        assert_eq!(derived(&["1234", "x"]), derived(&["1234", "x"]));
        assert_ne!(derived(&["ab", "c"]), derived(&["a", "bc"]));
        // FNV-1a 128 of nothing is its offset basis.
        assert_eq!(derived(&[]), "6c62272e07bb014262b821756295c58d");
    }
}
