//! Generate-and-load once per (kernel, architecture).
//!
//! Generating PTX and JIT-compiling it costs milliseconds to seconds, so each kernel is
//! built the first time it is asked for and shared afterwards as an `Arc<LoadedKernel>`.
//! A hit is one hash lookup under a mutex and allocates nothing.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::CudaContext;

use super::module::{self, LoadedKernel};
use crate::error::{Error, Result};

/// What a cached kernel is identified by.
#[derive(Debug, Clone)]
pub struct CacheKey {
    /// The kernel's identity; [`ModuleCache::get_or_load`] also uses it as the PTX entry name.
    pub kernel_id: String,
    /// The compute capability the PTX was generated for.
    pub arch: (i32, i32),
}

// A hit should not have to build a `CacheKey` (and allocate its `String`) just to look it up.
// std's HashMap only looks up through `Borrow`, so both the owned key and a borrowed
// `(&str, arch)` pair are viewed as `dyn KeyView`, which carries the one definition of
// hashing and equality that the `Borrow` contract requires them to share.
trait KeyView {
    fn kernel_id(&self) -> &str;
    fn arch(&self) -> (i32, i32);
}

impl KeyView for CacheKey {
    fn kernel_id(&self) -> &str {
        &self.kernel_id
    }
    fn arch(&self) -> (i32, i32) {
        self.arch
    }
}

impl KeyView for (&str, (i32, i32)) {
    fn kernel_id(&self) -> &str {
        self.0
    }
    fn arch(&self) -> (i32, i32) {
        self.1
    }
}

impl Hash for dyn KeyView + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.kernel_id().hash(state);
        self.arch().hash(state);
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.arch() == other.arch() && self.kernel_id() == other.kernel_id()
    }
}

impl Eq for dyn KeyView + '_ {}

impl<'a> Borrow<dyn KeyView + 'a> for CacheKey {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        self
    }
}

impl Hash for CacheKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self as &dyn KeyView).hash(state);
    }
}

impl PartialEq for CacheKey {
    fn eq(&self, other: &Self) -> bool {
        (self as &dyn KeyView) == (other as &dyn KeyView)
    }
}

impl Eq for CacheKey {}

/// A map whose values are created at most once per key. Generic over the value so the
/// once-only logic is testable without a GPU.
#[derive(Debug)]
struct OnceMap<V> {
    map: Mutex<HashMap<CacheKey, Arc<V>>>,
}

impl<V> Default for OnceMap<V> {
    fn default() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<V> OnceMap<V> {
    fn lock(&self) -> MutexGuard<'_, HashMap<CacheKey, Arc<V>>> {
        // A panic inside `make` poisons the mutex, but the map only ever receives fully
        // built values, so its contents are still valid: carry on with them.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value for `(kernel_id, arch)`, created by `make` if absent. The lock is held while
    /// `make` runs, so concurrent callers never create the same value twice (they wait). A
    /// failed `make` caches nothing; the next call tries again.
    fn get_or_insert_with<F>(&self, kernel_id: &str, arch: (i32, i32), make: F) -> Result<Arc<V>>
    where
        F: FnOnce() -> Result<V>,
    {
        let mut map = self.lock();
        if let Some(v) = map.get(&(kernel_id, arch) as &dyn KeyView) {
            return Ok(Arc::clone(v));
        }
        let v = Arc::new(make()?);
        let key = CacheKey {
            kernel_id: kernel_id.to_owned(),
            arch,
        };
        map.insert(key, Arc::clone(&v));
        Ok(v)
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    /// Every entry, sorted by kernel id then architecture for stable reports.
    fn entries(&self) -> Vec<(CacheKey, Arc<V>)> {
        let mut out: Vec<_> = self
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect();
        out.sort_by(|a, b| (&a.0.kernel_id, a.0.arch).cmp(&(&b.0.kernel_id, b.0.arch)));
        out
    }
}

/// Loaded kernels by (kernel id, architecture).
///
/// Modules belong to a CUDA context, so one cache serves one context (one device); a second
/// context gets its own cache. [`ModuleCache::get_or_load`] rejects a hit from another
/// context rather than hand out a function that cannot run there.
#[derive(Debug, Default)]
pub struct ModuleCache {
    inner: OnceMap<LoadedKernel>,
}

impl ModuleCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The kernel `kernel_id` for `arch`, loaded into `ctx` on first use.
    ///
    /// On a miss, `make` returns the PTX and the dynamic shared memory the kernel needs; the
    /// PTX must define an `.entry` named `kernel_id`. `make` runs at most once per key (while
    /// the cache is locked); if it or the load fails, nothing is cached and the error is
    /// returned.
    pub fn get_or_load(
        &self,
        ctx: &Arc<CudaContext>,
        kernel_id: &str,
        arch: (i32, i32),
        make: impl FnOnce() -> Result<(String, u32)>,
    ) -> Result<Arc<LoadedKernel>> {
        let kernel = self.inner.get_or_insert_with(kernel_id, arch, || {
            let (ptx, dynamic_smem) = make()?;
            module::load(ctx, &ptx, kernel_id, dynamic_smem)
        })?;
        if **kernel.context() != **ctx {
            return Err(Error::InvalidArgument(format!(
                "kernel {kernel_id} is cached for CUDA device {}, asked for on device {}; \
                 use one ModuleCache per context",
                kernel.context().ordinal(),
                ctx.ordinal()
            )));
        }
        Ok(kernel)
    }

    /// Number of kernels loaded.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(kernel id, arch, registers, local bytes)` for every loaded kernel, sorted by id.
    pub fn loaded(&self) -> Vec<(String, (i32, i32), i32, i32)> {
        self.inner
            .entries()
            .into_iter()
            .map(|(k, v)| (k.kernel_id, k.arch, v.registers, v.local_bytes))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn make_runs_once_per_key() {
        let cache = OnceMap::<String>::default();
        let calls = AtomicUsize::new(0);
        let make = |s: &str| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(s.to_owned())
        };

        let a1 = cache
            .get_or_insert_with("attn", (9, 0), || make("a"))
            .unwrap();
        let a2 = cache
            .get_or_insert_with("attn", (9, 0), || make("b"))
            .unwrap();
        assert!(Arc::ptr_eq(&a1, &a2));
        assert_eq!(*a2, "a");
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        // Another architecture or another id is another key.
        cache
            .get_or_insert_with("attn", (8, 9), || make("c"))
            .unwrap();
        cache
            .get_or_insert_with("attn2", (9, 0), || make("d"))
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(cache.len(), 3);

        let keys: Vec<_> = cache
            .entries()
            .into_iter()
            .map(|(k, v)| (k.kernel_id, k.arch, (*v).clone()))
            .collect();
        assert_eq!(
            keys,
            vec![
                ("attn".to_owned(), (8, 9), "c".to_owned()),
                ("attn".to_owned(), (9, 0), "a".to_owned()),
                ("attn2".to_owned(), (9, 0), "d".to_owned()),
            ]
        );
    }

    #[test]
    fn failures_are_not_cached() {
        let cache = OnceMap::<u32>::default();
        let err = cache.get_or_insert_with("k", (9, 0), || {
            Err(Error::InvalidArgument("generator failed".into()))
        });
        assert!(matches!(err, Err(Error::InvalidArgument(_))));
        assert_eq!(cache.len(), 0);
        assert_eq!(*cache.get_or_insert_with("k", (9, 0), || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn concurrent_callers_share_one_value() {
        let cache = OnceMap::<usize>::default();
        let calls = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let v = cache
                        .get_or_insert_with("k", (9, 0), || {
                            std::thread::sleep(std::time::Duration::from_millis(10));
                            Ok(calls.fetch_add(1, Ordering::SeqCst))
                        })
                        .unwrap();
                    assert_eq!(*v, 0);
                });
            }
        });
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn borrowed_and_owned_keys_agree() {
        use std::collections::hash_map::RandomState;
        use std::hash::BuildHasher;
        let s = RandomState::new();
        let owned = CacheKey {
            kernel_id: "fa3".into(),
            arch: (9, 0),
        };
        let borrowed = ("fa3", (9, 0));
        assert_eq!(
            s.hash_one(&owned),
            s.hash_one(&borrowed as &dyn KeyView),
            "Borrow requires equal hashes"
        );
        let viewed: &dyn KeyView = Borrow::<dyn KeyView>::borrow(&owned);
        assert!(viewed == &borrowed as &dyn KeyView);
    }

    #[test]
    fn empty_module_cache() {
        let c = ModuleCache::new();
        assert!(c.is_empty());
        assert!(c.loaded().is_empty());
    }
}
