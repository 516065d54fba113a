//! The block table: an open-addressing hash table of 8-byte [`Slot`]s that
//! holds no keys. A slot names where its block lives (run and offset) and
//! carries an 8-bit tag of the block's hash; whether a slot is a given
//! block's is for the caller to say (it reads the block from its run). So
//! the table cannot rehash itself: when [`BlockTable::fits`] says no, the
//! index rebuilds it from its runs, in memory order.
//!
//! Linear probing, at most 5/8 full. Inserts of new blocks and lookups
//! that miss are common and must probe to an empty slot, which stays short
//! at that load (under 4 slots on average at the worst, one cache line).
//! Deletion shifts the rest of the probe cluster back (no tombstones, so
//! an index under steady eviction never rebuilds its table): each slot
//! carries its distance from its home slot, so the shift reads no block
//! but that of an entry farther from home than a slot can say.
//!
//! [`BlockTable::prefetch`] lets a caller that knows the next blocks ask
//! for their cache lines ahead: a store of a long run of new blocks then
//! overlaps its cache misses instead of taking them one after another.

/// Where a block lives: its run and its offset in the run's lineage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub run: u32,
    pub offset: u32,
}

/// Lineage offsets stay below this, so that a table entry has room for a
/// hash tag and a probe distance (see [`Slot`]): a run is never extended to
/// it, and a longer store or imported run continues in a new run. (Small in
/// unit tests, so that they cross it.)
#[cfg(not(test))]
pub(super) const MAX_OFFSET: u32 = 1 << OFFSET_BITS;
#[cfg(test)]
pub(super) const MAX_OFFSET: u32 = 8;

const OFFSET_BITS: u32 = 18;
const DISTANCE_BITS: u32 = 6;
const TAG_BITS: u32 = 8;
/// A probe distance this large or larger is stored as this: the entry's
/// home is then computed from its block.
const FAR: u32 = (1 << DISTANCE_BITS) - 1;

/// A table entry: the block's [`Loc`], its distance from its home slot,
/// and an 8-bit tag of its hash (the second word: offset, below
/// [`MAX_OFFSET`], then distance, then tag). The tag rejects nearly every
/// other block met while probing without reading that block from its run
/// (a cache miss). Run `u32::MAX` is never used, so it marks empty slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    run: u32,
    offset_tag: u32,
}

const EMPTY: Slot = Slot {
    run: u32::MAX,
    offset_tag: u32::MAX,
};
const _: () = assert!(OFFSET_BITS + DISTANCE_BITS + TAG_BITS == 32);

impl Slot {
    pub fn new(loc: Loc, key: Key) -> Self {
        assert!(
            loc.offset < MAX_OFFSET,
            "lineage offsets stay below MAX_OFFSET"
        );
        debug_assert!(loc.run != u32::MAX);
        Slot {
            run: loc.run,
            offset_tag: loc.offset << (DISTANCE_BITS + TAG_BITS) | key.tag,
        }
    }

    pub fn run(self) -> u32 {
        self.run
    }

    pub fn loc(self) -> Loc {
        Loc {
            run: self.run,
            offset: self.offset_tag >> (DISTANCE_BITS + TAG_BITS),
        }
    }

    pub fn tag(self) -> u32 {
        self.offset_tag & ((1 << TAG_BITS) - 1)
    }

    /// The stored probe distance ([`FAR`]: at least that).
    fn distance(self) -> u32 {
        self.offset_tag >> TAG_BITS & FAR
    }

    fn with_distance(self, distance: usize) -> Self {
        let d = (distance as u32).min(FAR);
        Slot {
            run: self.run,
            offset_tag: self.offset_tag & !(FAR << TAG_BITS) | d << TAG_BITS,
        }
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
}

/// The maximum load: 5/8. At 3/4, lookups that
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
        }
    }

    pub fn len(&self) -> usize {
        self.live
    }

    /// Live entries the table holds at its maximum load.
    pub fn capacity(&self) -> usize {
        self.slots.len() / LOAD_DEN * LOAD_NUM
    }

    /// Whether `additional` inserts fit without a rebuild.
    pub fn fits(&self, additional: usize) -> bool {
        self.live + additional <= self.capacity()
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    #[inline]
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
    #[inline]
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
            if is(slot) {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub fn find(&self, hash: u64, is: impl FnMut(Slot) -> bool) -> Option<Slot> {
        self.position(hash, is).map(|i| self.slots[i])
    }

    /// Points the entry `is` accepts at `to`'s place; returns whether there
    /// was one.
    #[inline]
    pub fn replace(&mut self, hash: u64, is: impl FnMut(Slot) -> bool, to: Slot) -> bool {
        let Some(i) = self.position(hash, is) else {
            return false;
        };
        self.slots[i] = to.with_distance(self.slots[i].distance() as usize);
        true
    }

    /// Removes the entry `is` accepts; returns whether there was one. The
    /// entries after it in its probe cluster move back where they may;
    /// `hash_of` gives an entry's hash when its stored distance is [`FAR`].
    pub fn remove(
        &mut self,
        hash: u64,
        is: impl FnMut(Slot) -> bool,
        hash_of: impl Fn(Slot) -> u64,
    ) -> bool {
        let Some(mut hole) = self.position(hash, is) else {
            return false;
        };
        self.live -= 1;
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot == EMPTY {
                self.slots[hole] = EMPTY;
                return true;
            }
            let distance = match slot.distance() {
                FAR => j.wrapping_sub(self.home(hash_of(slot))) & mask,
                d => d as usize,
            };
            // The entry may fill the hole if the hole lies between its home
            // and where it is.
            let gap = j.wrapping_sub(hole) & mask;
            if gap <= distance {
                self.slots[hole] = slot.with_distance(distance - gap);
                hole = j;
            }
        }
    }

    /// Inserts `slot` unless an entry `is` accepts exists (then returns
    /// that entry and inserts nothing). The caller has made room
    /// ([`BlockTable::fits`]).
    #[inline]
    pub fn insert_new(
        &mut self,
        hash: u64,
        slot: Slot,
        mut is: impl FnMut(Slot) -> bool,
    ) -> Result<(), Slot> {
        debug_assert!(self.fits(1), "the caller makes room first");
        let mask = self.mask();
        let home = self.home(hash);
        let mut i = home;
        loop {
            let here = self.slots[i];
            if here == EMPTY {
                break;
            }
            if is(here) {
                return Err(here);
            }
            i = (i + 1) & mask;
        }
        self.slots[i] = slot.with_distance(i.wrapping_sub(home) & mask);
        self.live += 1;
        Ok(())
    }

    /// Inserts an entry known to be absent (a rebuild).
    #[inline]
    pub fn insert_unique(&mut self, hash: u64, slot: Slot) {
        let placed = self.insert_new(hash, slot, |_| false);
        debug_assert!(placed.is_ok());
    }

    /// Empties the table; its allocation stays.
    pub fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.live = 0;
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

    /// Key `k`'s entry: run `k`, tag `k`.
    fn slot(k: u64) -> Slot {
        Slot {
            run: k as u32,
            offset_tag: k as u32 & 0xFF,
        }
    }

    fn is(k: u64) -> impl Fn(Slot) -> bool {
        move |s: Slot| s.run == k as u32
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64),
        Remove(u64),
    }

    /// Few home slots for many keys, so that probes collide, wrap around
    /// the end, and clusters grow past the distance a slot can store.
    fn check(ops: Vec<Op>, keys: u64, homes: u64) -> Result<(), TestCaseError> {
        let mut table = BlockTable::with_capacity(keys as usize);
        // Homes near the table's end, so that clusters wrap around it.
        let hash = |k: u64| (k % homes).wrapping_mul(7).wrapping_sub(20);
        let hash_of = |s: Slot| hash(u64::from(s.run));
        let mut model: HashMap<u64, Slot> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(k) => {
                    let got = table.insert_new(hash(k), slot(k), is(k));
                    match model.get(&k) {
                        Some(_) => prop_assert!(got.is_err()),
                        None => {
                            prop_assert_eq!(got, Ok(()));
                            model.insert(k, slot(k));
                        }
                    }
                }
                Op::Remove(k) => {
                    let removed = table.remove(hash(k), is(k), hash_of);
                    prop_assert_eq!(removed, model.remove(&k).is_some());
                }
            }
            prop_assert_eq!(table.len(), model.len());
        }
        for k in 0..keys {
            let found = table.find(hash(k), is(k));
            prop_assert_eq!(found.map(Slot::loc), model.get(&k).map(|s| s.loc()));
        }
        // Every stored distance is the true one (or FAR for one at least
        // that far).
        let mask = table.mask();
        for (i, s) in table.slots.iter().enumerate() {
            if *s != EMPTY {
                let d = i.wrapping_sub(table.home(hash_of(*s))) & mask;
                prop_assert_eq!(s.distance() as usize, d.min(FAR as usize));
            }
        }
        Ok(())
    }

    fn ops(keys: u64) -> impl Strategy<Value = Vec<Op>> {
        let key = 0..keys;
        prop::collection::vec(
            prop_oneof![
                3 => key.clone().prop_map(Op::Insert),
                2 => key.prop_map(Op::Remove)
            ],
            0..600,
        )
    }

    proptest! {
        /// Against a HashMap: every key inserted and not removed is found,
        /// no other is, and the counts agree.
        #[test]
        fn the_table_holds_what_was_inserted_and_not_removed(ops in ops(48)) {
            check(ops, 48, 5)?;
        }

        /// The same with clusters longer than a stored distance reaches.
        #[test]
        fn entries_farther_than_a_slot_can_say_are_found_and_moved(ops in ops(160)) {
            check(ops, 160, 2)?;
        }
    }

    #[test]
    fn a_removal_moves_back_the_entries_that_probed_past_it() {
        let mut table = BlockTable::with_capacity(8);
        let hash_of = |_: Slot| 0;
        for k in 0..3 {
            table.insert_new(0, slot(k), is(k)).unwrap();
        }
        assert!(table.remove(0, is(0), hash_of));
        assert_eq!(table.slots[0].run, 1, "key 1 moved to its home slot");
        assert_eq!(table.slots[0].distance(), 0);
        assert_eq!(table.slots[1].run, 2);
        assert_eq!(table.slots[1].distance(), 1);
        assert_eq!(table.slots[2], EMPTY);
        assert_eq!(table.find(0, is(2)).map(|s| s.run), Some(2));
    }

    #[test]
    fn a_replaced_entry_keeps_its_distance() {
        let mut table = BlockTable::with_capacity(8);
        for k in 0..2 {
            table.insert_new(0, slot(k), is(k)).unwrap();
        }
        assert!(table.replace(0, is(1), slot(9)));
        assert_eq!(table.find(0, is(9)).map(Slot::distance), Some(1));
    }
}
