//! The mutator: fresh random inputs and "havoc" stacks of small edits on a corpus entry (bit
//! flips, interesting values, byte inserts and deletes, repeated chunks, splices with another
//! entry, truncation, dictionary tokens), in the manner of AFL's havoc stage. Deterministic
//! from the generator it is given.

use super::Target;
use crate::scheduler::score::SplitMix64;

/// Values at the edges of integer ranges, where arithmetic and length checks go wrong.
const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x7fff_ffff_ffff_ffff,
    0xffff_ffff_ffff_ffff,
];

/// Characters fresh text is made of: what the text formats' tokens are made of.
const TEXT: &[u8] = b" \t\n,0123456789abcdefghijklmnopqrstuvwxyzGPUNVX-.|\"";

/// Random bytes: printable text half the time (most targets read text), of a length that is
/// usually short.
pub fn fresh(rng: &mut SplitMix64, target: &Target) -> Vec<u8> {
    let cap = 1usize << rng.below(13);
    let len = rng.below(cap.min(target.max_len) as u64 + 1) as usize;
    let text = rng.below(2) == 0;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        if !target.dictionary.is_empty() && rng.below(8) == 0 {
            let token = target.dictionary[rng.below(target.dictionary.len() as u64) as usize];
            out.extend_from_slice(token);
        } else if text {
            out.push(TEXT[rng.below(TEXT.len() as u64) as usize]);
        } else {
            out.push(rng.next_u64() as u8);
        }
    }
    out.truncate(target.max_len);
    out
}

/// `corpus[base]` with 1 to 64 edits stacked on it (most often few).
pub fn havoc(rng: &mut SplitMix64, target: &Target, corpus: &[Vec<u8>], base: usize) -> Vec<u8> {
    let mut data = corpus[base].clone();
    let edits = 1 << rng.below(7);
    for _ in 0..rng.below(edits) + 1 {
        edit(rng, target, corpus, &mut data);
    }
    data.truncate(target.max_len);
    data
}

fn edit(rng: &mut SplitMix64, target: &Target, corpus: &[Vec<u8>], data: &mut Vec<u8>) {
    let len = data.len() as u64;
    let pos = |rng: &mut SplitMix64| rng.below(len.max(1)) as usize;
    match rng.below(14) {
        // Flip one bit.
        0 if len > 0 => {
            let at = pos(rng);
            data[at] ^= 1 << rng.below(8);
        }
        // A random byte.
        1 if len > 0 => {
            let at = pos(rng);
            data[at] = rng.next_u64() as u8;
        }
        // Add or subtract a little (counts and lengths off by a few).
        2 if len > 0 => {
            let at = pos(rng);
            let delta = rng.below(35) as u8 + 1;
            data[at] = if rng.below(2) == 0 {
                data[at].wrapping_add(delta)
            } else {
                data[at].wrapping_sub(delta)
            };
        }
        // An interesting value, 1, 2, 4 or 8 bytes wide, either byte order.
        3 if len > 0 => {
            let value = INTERESTING[rng.below(INTERESTING.len() as u64) as usize];
            let width = 1usize << rng.below(4);
            let bytes = if rng.below(2) == 0 {
                value.to_le_bytes()
            } else {
                value.to_be_bytes()
            };
            let bytes = if rng.below(2) == 0 {
                &bytes[..width]
            } else {
                &bytes[8 - width..]
            };
            let at = pos(rng);
            for (i, b) in bytes.iter().enumerate() {
                if let Some(slot) = data.get_mut(at + i) {
                    *slot = *b;
                }
            }
        }
        // An interesting number as decimal text (for the text formats).
        4 => {
            let value = INTERESTING[rng.below(INTERESTING.len() as u64) as usize];
            let text = match rng.below(3) {
                0 => value.to_string(),
                1 => (value as i64).to_string(),
                _ => value.wrapping_add(1).to_string(),
            };
            let at = rng.below(len + 1) as usize;
            let end = (at + rng.below(4) as usize).min(data.len());
            data.splice(at..end, text.into_bytes());
        }
        // Delete a run of bytes.
        5 | 6 if len > 0 => {
            let at = pos(rng);
            let n = (rng.below(16) as usize + 1).min(data.len() - at);
            data.drain(at..at + n);
        }
        // Insert random bytes.
        7 => {
            let at = rng.below(len + 1) as usize;
            let n = rng.below(8) as usize + 1;
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            data.splice(at..at, bytes);
        }
        // Repeat a chunk (lists grown long, lines duplicated).
        8 if len > 0 => {
            let at = pos(rng);
            let n = (rng.below(64) as usize + 1).min(data.len() - at);
            let chunk = data[at..at + n].to_vec();
            let times = 1 << rng.below(6);
            let mut grown = Vec::with_capacity(chunk.len() * times);
            for _ in 0..times {
                grown.extend_from_slice(&chunk);
            }
            data.splice(at..at, grown);
        }
        // Copy a chunk over another place.
        9 if len > 1 => {
            let from = pos(rng);
            let to = pos(rng);
            let n = (rng.below(32) as usize + 1)
                .min(data.len() - from)
                .min(data.len() - to);
            let chunk = data[from..from + n].to_vec();
            data[to..to + n].copy_from_slice(&chunk);
        }
        // Splice: our head, another entry's tail.
        10 if !corpus.is_empty() => {
            let other = &corpus[rng.below(corpus.len() as u64) as usize];
            let cut = rng.below(len + 1) as usize;
            let from = rng.below(other.len() as u64 + 1) as usize;
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
        }
        // Truncate.
        11 if len > 0 => {
            let cut = pos(rng);
            data.truncate(cut);
        }
        // A dictionary token, inserted or written over.
        12 | 13 if !target.dictionary.is_empty() => {
            let token = target.dictionary[rng.below(target.dictionary.len() as u64) as usize];
            let at = rng.below(len + 1) as usize;
            if rng.below(2) == 0 {
                data.splice(at..at, token.iter().copied());
            } else {
                let end = (at + token.len()).min(data.len());
                data.splice(at..end, token.iter().copied());
            }
        }
        _ => {
            let at = rng.below(len + 1) as usize;
            data.insert(at, rng.next_u64() as u8);
        }
    }
}
