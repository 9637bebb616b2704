//! Zeroing and copying without the object's `memset` and `memmove`.
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

/// Copies `*src` into `*dst` in 8-byte loads and stores. An assignment through two pointers
/// the compiler cannot prove apart (a map value into the scratch space) is otherwise a call
/// of the object's `memmove`, a byte loop like its `memset`.
///
/// # Safety
/// `src` must point at a readable `T` the verifier knows (a map value, the stack).
#[inline(always)]
pub unsafe fn copy<T: Copy>(dst: &mut T, src: *const T) {
    const {
        assert!(size_of::<T>().is_multiple_of(8) && align_of::<T>() >= 8);
    }
    let d = (dst as *mut T).cast::<u64>();
    let s = src.cast::<u64>();
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: within `*dst` and `*src`, 8-aligned and whole words; volatile so that LLVM
        // does not fold the copy back into a memmove call.
        unsafe { core::ptr::write_volatile(d.add(i), core::ptr::read_volatile(s.add(i))) };
    }
}

/// Copies `*src` into the uninitialized `*dst` in 2-byte loads and stores, for a `T` only
/// 2-aligned (a connection-tracking key), and returns the copy.
///
/// # Safety
/// `src` must point at a readable `T` the verifier knows; `T` plain bytes.
#[inline(always)]
pub unsafe fn copy_words<T: Copy>(dst: &mut MaybeUninit<T>, src: *const T) -> &T {
    const {
        assert!(size_of::<T>().is_multiple_of(2) && align_of::<T>() >= 2);
    }
    let d = dst.as_mut_ptr().cast::<u16>();
    let s = src.cast::<u16>();
    for i in 0..size_of::<T>() / 2 {
        // SAFETY: within `*dst` and `*src`, 2-aligned and whole words; volatile so that LLVM
        // neither folds the copy into a memmove call nor reads through `src` instead.
        unsafe { core::ptr::write_volatile(d.add(i), core::ptr::read_volatile(s.add(i))) };
    }
    // SAFETY: every byte was written.
    unsafe { dst.assume_init_ref() }
}
