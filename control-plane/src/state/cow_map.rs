//! An ordered map whose values are shared between copies and copied only when written: the
//! state's large maps (jobs, nodes, archived jobs) are of this kind so that a snapshot can take
//! a consistent copy of the state in a moment and serialize it after the state's lock is
//! released. Copying the map copies its keys and one pointer per value; a value is copied the
//! first time it is written while a copy still shares it (`Arc::make_mut`), so applies that
//! run during a snapshot copy only the records they change.
//!
//! It serializes exactly as the `BTreeMap` it replaces, so stored snapshots read either way.

use std::borrow::Borrow;
use std::collections::{BTreeMap, btree_map};
use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, PartialEq, Eq)]
pub struct CowMap<K, V> {
    map: BTreeMap<K, Arc<V>>,
}

impl<K, V> Default for CowMap<K, V> {
    fn default() -> Self {
        CowMap {
            map: BTreeMap::new(),
        }
    }
}

impl<K: Ord, V: Clone> CowMap<K, V> {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.map.get(key).map(|v| &**v)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.map.contains_key(key)
    }

    /// The value to change in place; copied first if a copy of the map still shares it.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.map.get_mut(key).map(Arc::make_mut)
    }

    /// Inserts a value, returning the one it replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.map.insert(key, Arc::new(value)).map(unshare)
    }

    /// Removes a value; it is moved out, or copied if a copy of the map still shares it.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.map.remove(key).map(unshare)
    }

    pub fn iter(&self) -> Iter<'_, K, V> {
        self.map.iter().map(deref_value)
    }

    pub fn keys(&self) -> btree_map::Keys<'_, K, Arc<V>> {
        self.map.keys()
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator + Clone {
        self.map.values().map(|v| &**v)
    }

    pub fn range<Q, R>(&self, range: R) -> impl DoubleEndedIterator<Item = (&K, &V)> + Clone
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
        R: RangeBounds<Q>,
    {
        self.map.range(range).map(deref_value)
    }
}

/// The value out of its shared pointer: moved if nothing else holds it, copied otherwise.
fn unshare<V: Clone>(value: Arc<V>) -> V {
    Arc::try_unwrap(value).unwrap_or_else(|shared| (*shared).clone())
}

/// Iterates a map's entries in key order.
pub type Iter<'a, K, V> =
    std::iter::Map<btree_map::Iter<'a, K, Arc<V>>, fn((&'a K, &'a Arc<V>)) -> (&'a K, &'a V)>;

fn deref_value<'a, K, V>((k, v): (&'a K, &'a Arc<V>)) -> (&'a K, &'a V) {
    (k, &**v)
}

impl<'a, K: Ord, V: Clone> IntoIterator for &'a CowMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<K, V, Q> std::ops::Index<&Q> for CowMap<K, V>
where
    K: Ord + Borrow<Q>,
    Q: Ord + ?Sized,
{
    type Output = V;

    /// The value for `key`; panics if there is none, as `BTreeMap`'s indexing does.
    fn index(&self, key: &Q) -> &V {
        &self.map[key]
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for CowMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        CowMap {
            map: iter.into_iter().map(|(k, v)| (k, Arc::new(v))).collect(),
        }
    }
}

impl<K: fmt::Debug, V: fmt::Debug> fmt::Debug for CowMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.map.iter()).finish()
    }
}

impl<K: Serialize, V: Serialize> Serialize for CowMap<K, V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.map.iter().map(|(k, v)| (k, &**v)))
    }
}

impl<'de, K, V> Deserialize<'de> for CowMap<K, V>
where
    K: Ord + Deserialize<'de>,
    V: Deserialize<'de>,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor<K, V>(PhantomData<(K, V)>);

        impl<'de, K, V> Visitor<'de> for MapVisitor<K, V>
        where
            K: Ord + Deserialize<'de>,
            V: Deserialize<'de>,
        {
            type Value = CowMap<K, V>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map")
            }

            // Entry by entry into the map, so a large map is never held twice while loading.
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut map = BTreeMap::new();
                while let Some((k, v)) = access.next_entry::<K, V>()? {
                    map.insert(k, Arc::new(v));
                }
                Ok(CowMap { map })
            }
        }

        deserializer.deserialize_map(MapVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_keeps_its_values_while_the_original_changes() {
        let mut map: CowMap<u64, String> = [(1, "a".to_string()), (2, "b".to_string())]
            .into_iter()
            .collect();
        let copy = map.clone();
        map.get_mut(&1).unwrap().push('!');
        map.insert(3, "c".into());
        assert_eq!(map.remove(&2).as_deref(), Some("b"));
        assert_eq!(copy.get(&1).map(String::as_str), Some("a"));
        assert_eq!(copy.get(&2).map(String::as_str), Some("b"));
        assert!(!copy.contains_key(&3));
        assert_eq!(map.get(&1).map(String::as_str), Some("a!"));
        let keys: Vec<u64> = map.keys().copied().collect();
        assert_eq!(keys, vec![1, 3]);
    }

    #[test]
    fn values_not_written_stay_shared() {
        let mut map: CowMap<u64, String> = [(1, "a".to_string()), (2, "b".to_string())]
            .into_iter()
            .collect();
        let copy = map.clone();
        map.get_mut(&1).unwrap().push('!');
        assert!(!Arc::ptr_eq(&map.map[&1], &copy.map[&1]));
        assert!(Arc::ptr_eq(&map.map[&2], &copy.map[&2]));
    }

    #[test]
    fn it_serializes_as_the_btree_map_it_replaces() {
        let plain: BTreeMap<u64, String> = [(1, "a".to_string()), (20, "b".to_string())].into();
        let cow: CowMap<u64, String> = plain.clone().into_iter().collect();
        let json = serde_json::to_string(&cow).unwrap();
        assert_eq!(json, serde_json::to_string(&plain).unwrap());
        let back: CowMap<u64, String> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, cow);
        let ranged: Vec<u64> = back.range(2..).map(|(k, _)| *k).collect();
        assert_eq!(ranged, vec![20]);
    }
}
