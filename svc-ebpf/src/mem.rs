//! Zeroing without the object's `memset`.
//!
//! BPF has no memset instruction, and the `memset` the compiler links in writes one byte per
//! loop round. LLVM calls it for any zeroed value of more than a few bytes (`[0u8; N]`,
//! `core::mem::zeroed()`, `Default::default()`): 64 rounds for a route lookup's parameters,
//! on every packet the programs route (perf: memset was 0.3 % of all CPU time in a UDP
//! exchange through a NodePort to a remote backend, and 0.5 % in a connection loop before the
//! parser stopped calling it).

use core::mem::{align_of, size_of, MaybeUninit};

/// Zeroes `*v` in 4-byte stores.
#[inline(always)]
pub fn zero<T>(v: &mut MaybeUninit<T>) {
    const {
        assert!(size_of::<T>().is_multiple_of(4) && align_of::<T>() >= 4);
    }
    let w = v.as_mut_ptr().cast::<u32>();
    for i in 0..size_of::<T>() / 4 {
        // SAFETY: within `*v`, which is 4-aligned and a whole number of words; volatile so
        // that LLVM does not fold the stores back into a memset call.
        unsafe { core::ptr::write_volatile(w.add(i), 0) };
    }
}

/// Zeroes `*v` in 4-byte stores, as `zero`.
///
/// # Safety
/// All-zero must be a valid `T` (a plain C struct or plain bytes).
#[inline(always)]
pub unsafe fn clear<T>(v: &mut T) {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout; the caller vouches for the zeroed value.
    zero(unsafe { &mut *(v as *mut T).cast::<MaybeUninit<T>>() });
}
