"""A taken TCP port, found before the models load (the front ends bind only after the loads)."""
import socket


def check_bindable(what, address, port, *, reuse_port=False):
    """OSError naming `what` when address:port cannot be bound. The probe sets the options the
    front end's listener sets (SO_REUSEADDR; SO_REUSEPORT where asked for), so that it refuses
    what the listener would refuse and no more: a port shared on purpose through
    SO_REUSEPORT (gRPC's grpc.so_reuseport=1) stays bindable."""
    if port == 0:
        return
    family, kind, proto, _name, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port and hasattr(socket, "SO_REUSEPORT"):
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind(sockaddr)
        except OSError as e:
            raise OSError(f"cannot bind {what} to {address}:{port}: {e.strerror}") from None
