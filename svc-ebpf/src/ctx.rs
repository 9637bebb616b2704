//! What the parser and the route lookup need of a program's context, so the tc programs and the
//! XDP program share them (docs/design/xdp.md): the packet's bytes, its device and length, and
//! the raw context the helpers take. Generic functions are compiled once per context type, so
//! the tc programs' code is what it was before the XDP program shared it.

use aya_ebpf::{
    bindings::BPF_CSUM_LEVEL_QUERY,
    helpers::generated::{bpf_csum_level, bpf_skb_load_bytes, bpf_xdp_load_bytes},
    programs::{TcContext, XdpContext},
};

pub trait Ctx {
    /// The XDP program: what only tc finishes (a drop or a refusal it counts, an answer it
    /// builds, a flow to a local backend) is left to it, untouched and with nothing stored.
    /// A constant: the tc programs' copies of shared code carry none of the XDP branches.
    const XDP: bool;
    /// Start of the packet's linear data (its Ethernet header).
    fn data(&self) -> usize;
    /// End of the linear data.
    fn data_end(&self) -> usize;
    /// The device the packet came in on (tc: the device the program runs on).
    fn ifindex(&self) -> u32;
    /// The packet's length, Ethernet header included.
    fn len(&self) -> u32;
    /// Copies `len` bytes at `off` to `buf`; false when the packet is shorter.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes of writes.
    unsafe fn load_bytes(&self, off: u32, buf: *mut u8, len: u32) -> bool;
    /// The context pointer the helpers take.
    fn raw(&self) -> *mut core::ffi::c_void;
    /// What a route lookup measures against the route's MTU (`bpf_fib_lookup`'s `tot_len`):
    /// 0 for tc, whose helper measures the skb itself; the IP packet's length for XDP, whose
    /// helper measures only what it is told.
    fn fib_len(&self) -> u16;
    /// Whether the device verified the packet's checksum (CHECKSUM_UNNECESSARY). Never known
    /// at XDP, which sees no checksum state.
    fn csum_verified(&self) -> bool;
}

impl Ctx for TcContext {
    const XDP: bool = false;

    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the kernel's __sk_buff; a single field load.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.skb.skb).len }
    }

    #[inline(always)]
    unsafe fn load_bytes(&self, off: u32, buf: *mut u8, len: u32) -> bool {
        // SAFETY: as the caller promises; the helper checks the packet bounds.
        unsafe { bpf_skb_load_bytes(self.skb.skb.cast(), off, buf.cast(), len) == 0 }
    }

    #[inline(always)]
    fn raw(&self) -> *mut core::ffi::c_void {
        self.skb.skb.cast()
    }

    #[inline(always)]
    fn fib_len(&self) -> u16 {
        0
    }

    #[inline(always)]
    fn csum_verified(&self) -> bool {
        // SAFETY: the query reads the skb's checksum state and changes nothing.
        unsafe { bpf_csum_level(self.skb.skb.cast(), BPF_CSUM_LEVEL_QUERY as u64) >= 0 }
    }
}

impl Ctx for XdpContext {
    const XDP: bool = true;

    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the kernel's xdp_md; a single field load.
        unsafe { (*self.ctx).ingress_ifindex }
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        // The program is loaded without multi-buffer support: the whole packet is linear.
        (self.data_end() - self.data()) as u32
    }

    #[inline(always)]
    unsafe fn load_bytes(&self, off: u32, buf: *mut u8, len: u32) -> bool {
        // SAFETY: as the caller promises; the helper checks the packet bounds.
        unsafe { bpf_xdp_load_bytes(self.ctx, off, buf.cast(), len) == 0 }
    }

    #[inline(always)]
    fn raw(&self) -> *mut core::ffi::c_void {
        self.ctx.cast()
    }

    #[inline(always)]
    fn fib_len(&self) -> u16 {
        (self.len().saturating_sub(crate::pkt::ETH_HLEN)) as u16
    }

    #[inline(always)]
    fn csum_verified(&self) -> bool {
        false
    }
}
