//! What the agent found the kernel to lack, as constants the verifier knows (svc-common's
//! `kernel_globals`). Each is a `static` in `.rodata`, which the loader patches before the
//! load and freezes (aya creates it `BPF_F_RDONLY_PROG`): a load from it is a known scalar to
//! the verifier, which then explores one side of the branch on it only. A privileged load
//! removes the side never explored (`opt_remove_dead_code`) before it resolves helper calls
//! (`do_misc_fixups`), so a helper the kernel lacks, called only on that side, is never
//! checked. An unprivileged load would only neutralize that code; the agent is privileged.
//!
//! Read with a volatile load: otherwise the compiler folds the object's default (1) into the
//! code, and the loader's value would change nothing.

#[unsafe(no_mangle)]
static SVC_KERNEL_SET_RETVAL: u32 = 1;

/// Whether the kernel has `bpf_set_retval` (Linux 5.18).
#[inline(always)]
pub fn has_set_retval() -> bool {
    // SAFETY: a static of this object.
    unsafe { core::ptr::read_volatile(&SVC_KERNEL_SET_RETVAL) != 0 }
}
