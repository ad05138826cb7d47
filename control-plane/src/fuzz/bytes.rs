//! A reader that turns fuzz bytes into structured choices (the idea of `arbitrary`'s
//! `Unstructured`, without the dependency): small choices take one byte, and an exhausted
//! input reads as zeros, so every byte string is a valid (if short) program for a generator.

/// Reads choices from the front of a byte string.
#[derive(Debug, Clone)]
pub struct ByteReader<'a> {
    data: &'a [u8],
}

impl<'a> ByteReader<'a> {
    pub fn new(data: &'a [u8]) -> ByteReader<'a> {
        ByteReader { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | (u32::from(self.u16()) << 16)
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// True with probability `k`/256.
    pub fn chance(&mut self, k: u8) -> bool {
        self.u8() < k
    }

    /// In `0..n` (0 when `n` is 0); one byte when `n` fits in one.
    pub fn below(&mut self, n: usize) -> usize {
        match n {
            0 => 0,
            1..=256 => self.u8() as usize % n,
            _ => self.u32() as usize % n,
        }
    }

    pub fn pick<'t, T>(&mut self, items: &'t [T]) -> &'t T {
        &items[self.below(items.len())]
    }

    /// A number that is usually small, sometimes at the edge of a range, sometimes anything.
    pub fn number(&mut self) -> u64 {
        match self.u8() {
            0..=159 => u64::from(self.u8()),
            160..=199 => u64::from(self.u16()),
            200..=239 => *self.pick(&[
                0,
                1,
                999,
                1000,
                4096,
                4097,
                u64::from(u32::MAX),
                i64::MAX as u64,
                u64::MAX - 1,
                u64::MAX,
            ]),
            _ => self.u64(),
        }
    }

    /// Up to `max` bytes as text (invalid UTF-8 replaced).
    pub fn string(&mut self, max: usize) -> String {
        let len = self.below(max + 1).min(self.data.len());
        let (text, rest) = self.data.split_at(len);
        self.data = rest;
        String::from_utf8_lossy(text).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exhausted_reader_reads_zeros() {
        let mut r = ByteReader::new(&[7]);
        assert_eq!(r.u8(), 7);
        assert!(r.is_empty());
        assert_eq!(r.u64(), 0);
        assert_eq!(r.below(5), 0);
        assert_eq!(r.string(10), "");
    }
}
