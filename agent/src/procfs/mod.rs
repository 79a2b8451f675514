//! Reading other processes: what the agent learns of a traced process from `/proc` and from inside
//! its root. Everything here is hostile input, chosen by the process being read (any process
//! named `haproxy` is one): paths resolve inside the process's root and never block ([`root`]),
//! reads are bounded by their callers, and nothing here runs on the capture thread but the socket
//! lookups of [`sockets`], which ask the socket itself first.
//!
//! - [`root`]: open a path as the process sees it (its root, its `chroot` jail);
//! - [`jail`]: the directories above a process's root, within its mount namespace;
//! - [`sockets`]: the bind address of a process's listening socket.

pub mod jail;
pub mod root;
pub mod sockets;
