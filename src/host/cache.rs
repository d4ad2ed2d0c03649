//! Generate-and-load once per (kernel, architecture).
//!
//! Generating PTX and JIT-compiling it costs milliseconds to seconds, so each kernel is
//! built the first time it is asked for and shared afterwards as an `Arc<LoadedKernel>`.
//! A hit is one hash lookup under a mutex and allocates nothing. A build runs outside
//! that mutex, so it never holds up calls for kernels already loaded.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::CudaContext;

use super::module::{self, Carveout, LoadedKernel};
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
///
/// The map lock is held only to find or insert a key's slot, never while a value is
/// built: each slot has its own build lock. So a slow first build (generating and
/// JIT-loading a kernel) blocks the callers of that key only, not hits on other keys nor
/// builds of other keys.
#[derive(Debug)]
struct OnceMap<V> {
    map: Mutex<HashMap<CacheKey, Arc<Slot<V>>>>,
}

/// One key's value, set once by whichever caller builds it first.
#[derive(Debug)]
struct Slot<V> {
    value: OnceLock<Arc<V>>,
    /// Held while the value is built, so it is built once; never taken on a hit.
    build: Mutex<()>,
}

impl<V> Default for OnceMap<V> {
    fn default() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<V> OnceMap<V> {
    fn lock(&self) -> MutexGuard<'_, HashMap<CacheKey, Arc<Slot<V>>>> {
        // Builds run outside this lock and a slot only ever receives a fully built value,
        // so a poisoned map is still consistent: carry on with it.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value for `(kernel_id, arch)`, created by `make` if absent.
    ///
    /// Concurrent callers of one key never create its value twice: the first runs `make`
    /// under the key's own lock and the others wait for it. Callers of other keys do not
    /// wait. A failed (or panicking) `make` caches nothing; the next call tries again.
    fn get_or_insert_with<F>(&self, kernel_id: &str, arch: (i32, i32), make: F) -> Result<Arc<V>>
    where
        F: FnOnce() -> Result<V>,
    {
        let slot = {
            let mut map = self.lock();
            match map.get(&(kernel_id, arch) as &dyn KeyView) {
                // The hit: one lookup, no allocation.
                Some(slot) => match slot.value.get() {
                    Some(v) => return Ok(Arc::clone(v)),
                    None => Arc::clone(slot),
                },
                None => {
                    let slot = Arc::new(Slot {
                        value: OnceLock::new(),
                        build: Mutex::new(()),
                    });
                    let key = CacheKey {
                        kernel_id: kernel_id.to_owned(),
                        arch,
                    };
                    map.insert(key, Arc::clone(&slot));
                    slot
                }
            }
        };
        // The map is unlocked: build (or wait for the build of) this key only. A panic in
        // an earlier `make` poisons the lock but set no value: build again.
        let _building = slot.build.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = slot.value.get() {
            return Ok(Arc::clone(v));
        }
        let v = Arc::new(make()?);
        // Only the holder of `build` sets the value, and it was empty: this cannot fail.
        let _ = slot.value.set(Arc::clone(&v));
        Ok(v)
    }

    /// Number of values built.
    fn len(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| s.value.get().is_some())
            .count()
    }

    /// Every built entry, sorted by kernel id then architecture for stable reports.
    fn entries(&self) -> Vec<(CacheKey, Arc<V>)> {
        let mut out: Vec<_> = self
            .lock()
            .iter()
            .filter_map(|(k, s)| s.value.get().map(|v| (k.clone(), Arc::clone(v))))
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
    /// PTX must define an `.entry` named `kernel_id`. `make` and the load run at most once
    /// per key, under that key's own lock: other callers of the same key wait for them,
    /// callers of other keys do not. If either fails, nothing is cached, the error is
    /// returned, and the next call tries again.
    pub fn get_or_load(
        &self,
        ctx: &Arc<CudaContext>,
        kernel_id: &str,
        arch: (i32, i32),
        make: impl FnOnce() -> Result<(String, u32)>,
    ) -> Result<Arc<LoadedKernel>> {
        self.get_or_load_with(ctx, kernel_id, arch, Carveout::Driver, make)
    }

    /// [`ModuleCache::get_or_load`], the kernel loaded with `carveout` (a kernel id
    /// always comes with the same one).
    pub fn get_or_load_with(
        &self,
        ctx: &Arc<CudaContext>,
        kernel_id: &str,
        arch: (i32, i32),
        carveout: Carveout,
        make: impl FnOnce() -> Result<(String, u32)>,
    ) -> Result<Arc<LoadedKernel>> {
        let kernel = self.inner.get_or_insert_with(kernel_id, arch, || {
            let (ptx, dynamic_smem) = make()?;
            module::load_with(ctx, &ptx, kernel_id, dynamic_smem, carveout)
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
    fn a_build_does_not_block_other_keys() {
        use std::sync::mpsc::channel;
        use std::time::Duration;
        // Long enough for any machine, short enough that a regression fails promptly.
        const PATIENCE: Duration = Duration::from_secs(10);

        let owned = OnceMap::<&'static str>::default();
        let cache = &owned;
        cache
            .get_or_insert_with("warm", (9, 0), || Ok("w"))
            .unwrap();
        let (entered_tx, entered_rx) = channel::<()>();
        let (release_tx, release_rx) = channel::<()>();
        let (hit_tx, hit_rx) = channel();
        let (other_tx, other_rx) = channel();
        std::thread::scope(|s| {
            // A: a slow build of "cold", blocked until released.
            let a = s.spawn(move || {
                cache.get_or_insert_with("cold", (9, 0), || {
                    entered_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok("c")
                })
            });
            entered_rx
                .recv_timeout(PATIENCE)
                .expect("the build of \"cold\" never started");
            // B: a hit on a built key. C: the build of another key.
            s.spawn(|| {
                let r = cache.get_or_insert_with("warm", (9, 0), || Ok("rebuilt"));
                hit_tx.send(r.map(|v| *v).ok()).unwrap();
            });
            s.spawn(|| {
                let r = cache.get_or_insert_with("other", (9, 0), || Ok("o"));
                other_tx.send(r.map(|v| *v).ok()).unwrap();
            });
            let hit = hit_rx.recv_timeout(PATIENCE);
            let other = other_rx.recv_timeout(PATIENCE);
            // Release A whatever happened, so a failure cannot hang the test.
            release_tx.send(()).unwrap();
            assert_eq!(
                hit,
                Ok(Some("w")),
                "a hit on a built key waited for another key's build (Err = timed out)"
            );
            assert_eq!(
                other,
                Ok(Some("o")),
                "a build waited for another key's build (Err = timed out)"
            );
            assert_eq!(*a.join().unwrap().unwrap(), "c");
        });
        assert_eq!(owned.len(), 3);
    }

    #[test]
    fn same_key_callers_wait_for_the_one_build() {
        use std::sync::mpsc::channel;
        use std::time::Duration;
        let owned = OnceMap::<usize>::default();
        let cache = &owned;
        let calls = &AtomicUsize::new(0);
        let (entered_tx, entered_rx) = channel::<()>();
        let (release_tx, release_rx) = channel::<()>();
        std::thread::scope(|s| {
            let a = s.spawn(move || {
                cache.get_or_insert_with("k", (9, 0), || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    entered_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok(1)
                })
            });
            entered_rx
                .recv_timeout(Duration::from_secs(10))
                .expect("the build never started");
            let b = s.spawn(|| {
                cache.get_or_insert_with("k", (9, 0), || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok(2)
                })
            });
            // B cannot have built: the key's build is still in progress.
            std::thread::sleep(Duration::from_millis(50));
            release_tx.send(()).unwrap();
            let (va, vb) = (a.join().unwrap().unwrap(), b.join().unwrap().unwrap());
            assert!(Arc::ptr_eq(&va, &vb));
            assert_eq!(*vb, 1);
        });
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_panicking_build_caches_nothing() {
        let cache = OnceMap::<u32>::default();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cache.get_or_insert_with("k", (9, 0), || panic!("generator bug"))
        }));
        assert!(r.is_err());
        assert_eq!(cache.len(), 0);
        assert!(cache.entries().is_empty());
        assert_eq!(*cache.get_or_insert_with("k", (9, 0), || Ok(3)).unwrap(), 3);
        assert_eq!(cache.len(), 1);
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
