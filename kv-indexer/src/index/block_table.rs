//! The block table: an open-addressing hash table of 8-byte [`Slot`]s that
//! holds no keys. A slot names where its block lives (run and offset) and
//! carries an 8-bit tag of the block's hash; whether a slot is a given
//! block's is for the caller to say (it reads the block from its run). So
//! the table cannot rehash itself: when [`BlockTable::fits`] says no, the
//! index rebuilds it from its runs, in memory order.
//!
//! Linear probing, at most 5/8 full (live plus deleted slots). Inserts of
//! new blocks and lookups that miss are common and must probe to an empty
//! slot, which stays short at that load (under 4 slots on average at the
//! worst, one cache line). Deleted slots become empty at once when the slot
//! after them is empty, so tombstones stay few. [`BlockTable::prefetch`] lets a caller
//! that knows the next blocks ask for their cache lines ahead: a store of
//! a long run of new blocks then overlaps its cache misses instead of
//! taking them one after another.

/// Where a block lives: its run and its offset in the run's lineage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub run: u32,
    pub offset: u32,
}

/// Lineage offsets stay below this, so that a table entry has room for a
/// hash tag (see [`Slot`]): a run is never extended to it, and a longer
/// store or imported run continues in a new run. (Small in unit tests, so
/// that they cross it.)
#[cfg(not(test))]
pub(super) const MAX_OFFSET: u32 = 1 << 24;
#[cfg(test)]
pub(super) const MAX_OFFSET: u32 = 8;

/// A table entry: the block's [`Loc`] and an 8-bit tag of its hash (the
/// offset, below [`MAX_OFFSET`], takes the other 24 bits of the second
/// word). The tag rejects nearly every other block met while probing
/// without reading that block from its run (a cache miss). Run
/// `u32::MAX` is never used, so it marks empty and deleted slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    run: u32,
    offset_tag: u32,
}

const EMPTY: Slot = Slot {
    run: u32::MAX,
    offset_tag: u32::MAX,
};
const DELETED: Slot = Slot {
    run: u32::MAX,
    offset_tag: u32::MAX - 1,
};

impl Slot {
    pub fn new(loc: Loc, key: Key) -> Self {
        debug_assert!(loc.offset < MAX_OFFSET);
        debug_assert!(loc.run != u32::MAX);
        Slot {
            run: loc.run,
            offset_tag: loc.offset << 8 | key.tag,
        }
    }

    pub fn run(self) -> u32 {
        self.run
    }

    pub fn loc(self) -> Loc {
        Loc {
            run: self.run,
            offset: self.offset_tag >> 8,
        }
    }

    pub fn tag(self) -> u32 {
        self.offset_tag & 0xFF
    }

    fn is_live(self) -> bool {
        self.run != u32::MAX
    }
}

/// A block's table hash and tag, computed once per lookup.
#[derive(Debug, Clone, Copy)]
pub(super) struct Key {
    pub block: protocol::BlockHash,
    pub hash: u64,
    pub tag: u32,
}

impl Key {
    pub fn of(block: protocol::BlockHash) -> Self {
        // Block hashes are already uniform; the multiplies spread small test
        // values over the low (bucket) bits, and over the tag, independently.
        let x = block.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let tag = (block.0.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 56) as u32;
        Key {
            block,
            hash: x ^ (x >> 32),
            tag,
        }
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct BlockTable {
    /// A power of two in length, or empty.
    slots: Vec<Slot>,
    live: usize,
    deleted: usize,
}

/// The maximum load, live plus deleted slots: 5/8. At 3/4, lookups that
/// miss took three times as long and the Mooncake replay 20% longer; at 1/2
/// the table is larger for no faster apply (`cargo bench -p kv-indexer
/// --bench index`).
const LOAD_NUM: usize = 5;
const LOAD_DEN: usize = 8;

/// Slots needed so that `entries` fit at the maximum load.
fn slots_for(entries: usize) -> usize {
    (entries.saturating_mul(LOAD_DEN).div_ceil(LOAD_NUM))
        .next_power_of_two()
        .max(16)
}

impl BlockTable {
    /// A table with room for `entries` live entries.
    pub fn with_capacity(entries: usize) -> Self {
        BlockTable {
            slots: vec![EMPTY; slots_for(entries)],
            live: 0,
            deleted: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.live
    }

    /// Live entries the table holds at its maximum load.
    pub fn capacity(&self) -> usize {
        self.slots.len() / LOAD_DEN * LOAD_NUM
    }

    /// Whether `additional` inserts fit without a rebuild (deleted slots
    /// count as taken until then).
    pub fn fits(&self, additional: usize) -> bool {
        self.live + self.deleted + additional <= self.capacity()
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    fn home(&self, hash: u64) -> usize {
        hash as usize & self.mask()
    }

    /// Asks for the cache line where a probe for `hash` starts.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        if let Some(slot) = self.slots.get(self.home(hash)) {
            prefetch_read(slot);
        }
    }

    /// The index of the live slot `is` accepts, probing from `hash`'s home.
    fn position(&self, hash: u64, mut is: impl FnMut(Slot) -> bool) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(hash);
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                return None;
            }
            if slot.is_live() && is(slot) {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    pub fn find(&self, hash: u64, is: impl FnMut(Slot) -> bool) -> Option<Slot> {
        self.position(hash, is).map(|i| self.slots[i])
    }

    pub fn find_mut(&mut self, hash: u64, is: impl FnMut(Slot) -> bool) -> Option<&mut Slot> {
        self.position(hash, is).map(|i| &mut self.slots[i])
    }

    /// Removes the entry `is` accepts; returns whether there was one.
    pub fn remove(&mut self, hash: u64, is: impl FnMut(Slot) -> bool) -> bool {
        let Some(mut i) = self.position(hash, is) else {
            return false;
        };
        self.live -= 1;
        let mask = self.mask();
        if self.slots[(i + 1) & mask] != EMPTY {
            self.slots[i] = DELETED;
            self.deleted += 1;
            return true;
        }
        // No probe passes through this slot to reach a later one: it, and
        // the deleted slots just before it, become empty.
        self.slots[i] = EMPTY;
        loop {
            i = i.wrapping_sub(1) & mask;
            if self.slots[i] != DELETED {
                return true;
            }
            self.slots[i] = EMPTY;
            self.deleted -= 1;
        }
    }

    /// Inserts `slot` unless an entry `is` accepts exists (then returns
    /// that entry and inserts nothing). The caller has made room
    /// ([`BlockTable::fits`]).
    pub fn insert_new(
        &mut self,
        hash: u64,
        slot: Slot,
        mut is: impl FnMut(Slot) -> bool,
    ) -> Result<(), Slot> {
        debug_assert!(self.fits(1), "the caller makes room first");
        let mask = self.mask();
        let mut i = self.home(hash);
        let mut reuse = None;
        loop {
            let here = self.slots[i];
            if here == EMPTY {
                break;
            }
            if here == DELETED {
                reuse.get_or_insert(i);
            } else if is(here) {
                return Err(here);
            }
            i = (i + 1) & mask;
        }
        if let Some(at) = reuse {
            i = at;
            self.deleted -= 1;
        }
        self.slots[i] = slot;
        self.live += 1;
        Ok(())
    }

    /// Inserts an entry known to be absent (a rebuild).
    pub fn insert_unique(&mut self, hash: u64, slot: Slot) {
        debug_assert!(self.fits(1), "the caller makes room first");
        let mask = self.mask();
        let mut i = self.home(hash);
        while self.slots[i].is_live() {
            i = (i + 1) & mask;
        }
        if self.slots[i] == DELETED {
            self.deleted -= 1;
        }
        self.slots[i] = slot;
        self.live += 1;
    }

    /// Empties the table; its allocation stays.
    pub fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.live = 0;
        self.deleted = 0;
    }
}

/// A hint to the CPU to fetch `value`'s cache line; no effect on results.
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch_read<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault;
    // the pointer comes from a reference, and SSE is part of x86_64.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn slot(run: u32, tag: u32) -> Slot {
        Slot {
            run,
            offset_tag: tag & 0xFF,
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64),
        Remove(u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        // Few distinct keys and few home buckets, so that probes collide,
        // wrap around the end, and cross deleted slots.
        let key = 0u64..48;
        prop::collection::vec(
            prop_oneof![key.clone().prop_map(Op::Insert), key.prop_map(Op::Remove)],
            0..400,
        )
    }

    proptest! {
        /// Against a HashMap: every key inserted and not removed is found,
        /// no other is, and the counts agree; the table's hash of key `k`
        /// is `k % 5` so that clusters form.
        #[test]
        fn the_table_holds_what_was_inserted_and_not_removed(ops in ops()) {
            let mut table = BlockTable::with_capacity(48);
            let mut model: HashMap<u64, Slot> = HashMap::new();
            let is = |k: u64| move |s: Slot| s.run == k as u32;
            for op in ops {
                match op {
                    Op::Insert(k) => {
                        let new = slot(k as u32, k as u32);
                        let got = table.insert_new(k % 5, new, is(k));
                        match model.get(&k) {
                            Some(old) => prop_assert_eq!(got, Err(*old)),
                            None => {
                                prop_assert_eq!(got, Ok(()));
                                model.insert(k, new);
                            }
                        }
                    }
                    Op::Remove(k) => {
                        prop_assert_eq!(table.remove(k % 5, is(k)), model.remove(&k).is_some());
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert!(table.live + table.deleted <= table.slots.len());
            }
            for k in 0..48 {
                prop_assert_eq!(table.find(k % 5, is(k)), model.get(&k).copied());
            }
        }
    }

    #[test]
    fn a_removed_slot_before_an_empty_one_leaves_no_tombstone() {
        let mut table = BlockTable::with_capacity(8);
        let is = |k: u32| move |s: Slot| s.run == k;
        for k in 0..3 {
            table.insert_new(0, slot(k, 0), is(k)).unwrap();
        }
        assert!(table.remove(0, is(1)));
        assert_eq!(
            table.deleted, 1,
            "slot 2 still needs the probe to pass slot 1"
        );
        assert!(table.remove(0, is(2)));
        assert_eq!(table.deleted, 0, "slots 1 and 2 are empty again");
        assert_eq!(table.find(0, is(0)), Some(slot(0, 0)));
        assert_eq!(table.find(0, is(2)), None);
    }

    #[test]
    fn an_insert_reuses_a_deleted_slot_but_still_finds_a_later_duplicate() {
        let mut table = BlockTable::with_capacity(8);
        let is = |k: u32| move |s: Slot| s.run == k;
        for k in 0..3 {
            table.insert_new(0, slot(k, 0), is(k)).unwrap();
        }
        assert!(table.remove(0, is(0)));
        assert_eq!(table.insert_new(0, slot(2, 9), is(2)), Err(slot(2, 0)));
        table.insert_new(0, slot(7, 0), is(7)).unwrap();
        assert_eq!(table.deleted, 0);
        assert_eq!(table.len(), 3);
    }
}
