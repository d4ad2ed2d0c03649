//! Random validation inputs for the host layer's tests (test builds only): views whose
//! shapes run from edge values to 2^63, strides contiguous in either order or drawn (zero,
//! misaligned, huge), pointers null, misaligned or at the end of the address space.

use crate::host::tensor::{DType, TensorView};

/// A small deterministic generator of validation inputs (splitmix64). Tame draws keep to
/// what a careful caller passes (small sizes, head dims that are multiples of 8, pointers
/// in distinct 64 GiB slots, contiguous views, one 16-bit dtype), so that the validators'
/// accepting end is reached too.
pub(crate) struct Draw {
    state: u64,
    tame: bool,
    slot: u64,
}

impl Draw {
    pub(crate) fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[(self.next() % from.len() as u64) as usize]
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    pub(crate) fn size(&mut self) -> usize {
        if self.tame || self.chance(0.8) {
            self.pick(&[1, 1, 2, 3, 4, 7, 8, 16, 17, 64, 113, 300])
        } else {
            self.pick(&[0, 1 << 16, 1 << 20, 1 << 31, 1 << 40, usize::MAX >> 1])
        }
    }

    pub(crate) fn head_dim(&mut self) -> usize {
        if self.tame {
            return 8 * (1 + self.next() % 32) as usize;
        }
        self.pick(&[
            0,
            1,
            8,
            16,
            32,
            40,
            64,
            72,
            80,
            84,
            96,
            120,
            128,
            136,
            160,
            192,
            200,
            248,
            256,
            264,
            512,
            1 << 33,
        ])
    }

    pub(crate) fn ptr(&mut self) -> u64 {
        if self.tame {
            self.slot += 1;
            return self.slot << 36;
        }
        let gb = 1 + self.next() % 64;
        match self.next() % 10 {
            0 => 0,
            1 => (gb << 30) + 8,
            2 => (gb << 30) + 2,
            3 => u64::MAX - 64,
            _ => gb << 30,
        }
    }

    /// A view of `shape`: contiguous in either order, or strides drawn one by one.
    pub(crate) fn view(&mut self, dtype: DType, shape: [usize; 4]) -> TensorView {
        let [b, s, h, d] = shape;
        let ptr = self.ptr();
        if self.tame {
            return TensorView::bshd(ptr, dtype, b, s, h, d);
        }
        match self.next() % 4 {
            0 | 1 => TensorView::bshd(ptr, dtype, b, s, h, d),
            2 => TensorView::bhsd(ptr, dtype, b, s, h, d),
            _ => {
                let mut strides = [0; 4];
                for st in &mut strides {
                    *st =
                        self.pick(&[0, 1, 8, 16, d, h.wrapping_mul(d), 4096, 1 << 37, usize::MAX]);
                }
                if self.chance(0.7) {
                    strides[3] = 1;
                }
                TensorView::strided(ptr, dtype, shape, strides)
            }
        }
    }

    /// A softmax scale as a caller may pass it: none (the default), usual, large, or
    /// one validation must refuse (0, negative, NaN, infinite).
    pub(crate) fn softmax_scale(&mut self) -> Option<f32> {
        self.pick(&[
            None,
            None,
            Some(0.125),
            Some(3.0),
            Some(0.0),
            Some(-1.0),
            Some(f32::NAN),
            Some(f32::INFINITY),
        ])
    }

    /// A view of `shape` of any dtype.
    pub(crate) fn any_view(&mut self, shape: [usize; 4]) -> TensorView {
        let dtype = self.dtype();
        self.view(dtype, shape)
    }

    pub(crate) fn dtype(&mut self) -> DType {
        if self.tame {
            return DType::F16;
        }
        self.pick(&[DType::F16, DType::F16, DType::Bf16, DType::F32, DType::E4m3])
    }
}

impl Draw {
    pub(crate) fn new(seed: u64) -> Draw {
        Draw {
            state: seed,
            tame: false,
            slot: 0,
        }
    }

    /// Starts a draw of one call's inputs: tame or not, pointers from the first slot.
    pub(crate) fn start(&mut self, tame: bool) {
        self.tame = tame;
        self.slot = 0;
    }
}
