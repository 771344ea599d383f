//! The store's secret (SPEC §13): 32 random bytes made with a new store and kept in it (sealed
//! when `store.encrypt_key_env` is set), which key the principals, fingerprints and body digests
//! the proxy writes into its records and its write log ([`crate::identity::Keyer`]).
//!
//! Only a store with no history is given one: a store made before stores had a secret keeps
//! its plain SHA-256 values, since its records' action ids were derived from them, and a retry
//! under another id would be sent again (decision 0046).

use super::seal::Sealer;
use crate::identity::Keyer;

/// A new secret, from the system's random source.
pub fn draw() -> [u8; 32] {
    let mut b = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .expect("the system's random source");
    b
}

/// The secret as the store keeps it: sealed with the store's key, if it has one.
pub fn stored(secret: &[u8; 32], sealer: Option<&Sealer>) -> Vec<u8> {
    match sealer {
        Some(s) => s.seal(secret),
        None => secret.to_vec(),
    }
}

/// The keyer of a store that keeps `value` (`None`: a store from before secrets).
pub fn keyer(value: Option<&[u8]>, sealer: Option<&Sealer>) -> Result<Keyer, String> {
    let Some(v) = value else {
        return Ok(Keyer::unkeyed());
    };
    let plain =
        match sealer {
            Some(s) => s.open(v)?,
            None if v.starts_with(super::seal::MAGIC) => return Err(
                "the store's secret is sealed, but no key is configured: set store.encrypt_key_env"
                    .into(),
            ),
            None => v.to_vec(),
        };
    if plain.len() != 32 {
        return Err(format!(
            "the store's secret is {} bytes, not 32: it was damaged",
            plain.len()
        ));
    }
    Ok(Keyer::new(&plain))
}
