//! Block-level barriers.

use super::PtxError;
use super::kernel::Kernel;

impl Kernel {
    /// `bar.sync id` for the whole block, or `bar.sync id, threads` for the first
    /// `threads` threads that arrive (a multiple of 32). Ids are 0..=15; 0 is `__syncthreads`.
    pub fn bar_sync(&mut self, id: u32, threads: Option<u32>) {
        if id > 15 {
            self.fail(PtxError::BadOperand(format!("barrier id {id} > 15")));
        }
        match threads {
            None => self.emit(format!("bar.sync {id};")),
            Some(n) => {
                if n == 0 || n % 32 != 0 {
                    self.fail(PtxError::BadOperand(format!("barrier thread count {n}")));
                }
                self.emit(format!("bar.sync {id}, {n};"));
            }
        }
    }

    /// `bar.sync 0`: every thread of the block.
    pub fn sync_threads(&mut self) {
        self.bar_sync(0, None);
    }
}
