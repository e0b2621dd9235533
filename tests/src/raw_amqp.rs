//! A publisher that writes AMQP 0-9-1 frames by hand, for the attack tests:
//! it sends properties and headers as raw bytes, so a test can send what no
//! client library would encode (header tables nested thousands of levels
//! deep, header frames larger than a consumer's `frame_max`, broken
//! encodings) and see what the broker lets through to sas.
//!
//! Only what a publisher needs: the handshake (PLAIN, guest), one channel in
//! confirm mode, `basic.publish` with a content header and body frames,
//! one at a time ([`RawPublisher::publish`]) or many before their confirms
//! ([`RawPublisher::send`], [`RawPublisher::wait_confirms`]). [`Basic`]
//! encodes every basic property from raw bytes and [`Field`] every field
//! type of a header table, the broker's and the spec's.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;
/// The largest frame this publisher takes when the server sets none.
const FRAME_MAX: u32 = 128 * 1024;

/// Basic properties' flag bits (AMQP 0-9-1, class `basic`).
pub mod flag {
    pub const CONTENT_TYPE: u16 = 1 << 15;
    pub const CONTENT_ENCODING: u16 = 1 << 14;
    pub const HEADERS: u16 = 1 << 13;
    pub const DELIVERY_MODE: u16 = 1 << 12;
    pub const PRIORITY: u16 = 1 << 11;
    pub const CORRELATION_ID: u16 = 1 << 10;
    pub const REPLY_TO: u16 = 1 << 9;
    pub const EXPIRATION: u16 = 1 << 8;
    pub const MESSAGE_ID: u16 = 1 << 7;
    pub const TIMESTAMP: u16 = 1 << 6;
    pub const TYPE: u16 = 1 << 5;
    pub const USER_ID: u16 = 1 << 4;
    pub const APP_ID: u16 = 1 << 3;
    pub const CLUSTER_ID: u16 = 1 << 2;
}

/// Why a raw publish did not go through.
#[derive(Debug)]
pub enum RawError {
    Io(std::io::Error),
    /// The broker closed the connection or the channel (it refused what
    /// was sent): its reply code and text.
    Closed(u16, String),
    /// The broker nacked the message.
    Nacked,
    /// Something this publisher does not expect.
    Protocol(String),
}

impl From<std::io::Error> for RawError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// Encoded basic properties: the flags and the property list, in order.
#[derive(Debug, Clone, Default)]
pub struct Properties {
    pub flags: u16,
    pub list: Vec<u8>,
}

impl Properties {
    /// Properties of the usual fields, each encoded as AMQP says, with a
    /// raw header table (its content, without the length) when given.
    pub fn new(reply_to: Option<&str>, headers: Option<&[u8]>) -> Self {
        let mut p = Self::default();
        p.flags |= flag::CONTENT_TYPE;
        short_string(&mut p.list, "application/json");
        if let Some(h) = headers {
            p.flags |= flag::HEADERS;
            long_bytes(&mut p.list, h);
        }
        p.flags |= flag::DELIVERY_MODE;
        p.list.push(2);
        if let Some(q) = reply_to {
            p.flags |= flag::REPLY_TO;
            short_string(&mut p.list, q);
        }
        p
    }
}

/// Every basic property, each absent or as raw bytes (short strings are
/// cut at 255 bytes; they may hold anything, invalid UTF-8 included).
#[derive(Debug, Clone, Default)]
pub struct Basic {
    pub content_type: Option<Vec<u8>>,
    pub content_encoding: Option<Vec<u8>>,
    /// A header table's content, without its length (see [`table`]).
    pub headers: Option<Vec<u8>>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<Vec<u8>>,
    pub reply_to: Option<Vec<u8>>,
    pub expiration: Option<Vec<u8>>,
    pub message_id: Option<Vec<u8>>,
    pub timestamp: Option<u64>,
    pub kind: Option<Vec<u8>>,
    pub user_id: Option<Vec<u8>>,
    pub app_id: Option<Vec<u8>>,
    pub cluster_id: Option<Vec<u8>>,
}

impl Basic {
    /// The properties on the wire: flags, then the present ones in flag order.
    pub fn encode(&self) -> Properties {
        let mut p = Properties::default();
        let short = |p: &mut Properties, bit: u16, v: &Option<Vec<u8>>| {
            if let Some(v) = v {
                p.flags |= bit;
                short_bytes(&mut p.list, v);
            }
        };
        short(&mut p, flag::CONTENT_TYPE, &self.content_type);
        short(&mut p, flag::CONTENT_ENCODING, &self.content_encoding);
        if let Some(h) = &self.headers {
            p.flags |= flag::HEADERS;
            long_bytes(&mut p.list, h);
        }
        if let Some(m) = self.delivery_mode {
            p.flags |= flag::DELIVERY_MODE;
            p.list.push(m);
        }
        if let Some(m) = self.priority {
            p.flags |= flag::PRIORITY;
            p.list.push(m);
        }
        short(&mut p, flag::CORRELATION_ID, &self.correlation_id);
        short(&mut p, flag::REPLY_TO, &self.reply_to);
        short(&mut p, flag::EXPIRATION, &self.expiration);
        short(&mut p, flag::MESSAGE_ID, &self.message_id);
        if let Some(t) = self.timestamp {
            p.flags |= flag::TIMESTAMP;
            p.list.extend_from_slice(&t.to_be_bytes());
        }
        short(&mut p, flag::TYPE, &self.kind);
        short(&mut p, flag::USER_ID, &self.user_id);
        short(&mut p, flag::APP_ID, &self.app_id);
        short(&mut p, flag::CLUSTER_ID, &self.cluster_id);
        p
    }
}

/// A header value of any field type, written with its type letter as
/// RabbitMQ reads them (`s` a short int, `x` a byte array), or any letter
/// and bytes as given ([`Field::Raw`]: the spec's `U`, `L`, `s` short
/// string, letters nobody reads).
#[derive(Debug, Clone, PartialEq)]
pub enum Field {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    F64(f64),
    Decimal(u8, u32),
    LongString(Vec<u8>),
    Bytes(Vec<u8>),
    Timestamp(u64),
    Void,
    Array(Vec<Field>),
    /// Entries in order, keys as raw bytes (duplicates allowed).
    Table(Vec<(Vec<u8>, Field)>),
    /// `levels` arrays (or tables, each with one entry `t`) nested in each
    /// other around an empty one, written without recursion.
    Deep {
        levels: usize,
        tables: bool,
    },
    /// A type letter and the bytes that follow it, as given.
    Raw(u8, Vec<u8>),
}

impl Field {
    /// How deep tables and arrays nest in this value: 0 for a scalar, 1
    /// for a flat array or table (as `sas::broker::headers::nesting`
    /// counts, less the header table itself).
    pub fn depth(&self) -> usize {
        match self {
            Self::Array(items) => 1 + items.iter().map(Self::depth).max().unwrap_or(0),
            Self::Table(entries) => 1 + entries.iter().map(|(_, v)| v.depth()).max().unwrap_or(0),
            Self::Deep { levels, .. } => *levels,
            _ => 0,
        }
    }

    /// Appends the type letter and the value.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::Bool(b) => out.extend_from_slice(&[b't', u8::from(*b)]),
            Self::I8(v) => out.extend_from_slice(&[b'b', *v as u8]),
            Self::U8(v) => out.extend_from_slice(&[b'B', *v]),
            Self::I16(v) => tagged(out, b's', &v.to_be_bytes()),
            Self::U16(v) => tagged(out, b'u', &v.to_be_bytes()),
            Self::I32(v) => tagged(out, b'I', &v.to_be_bytes()),
            Self::U32(v) => tagged(out, b'i', &v.to_be_bytes()),
            Self::I64(v) => tagged(out, b'l', &v.to_be_bytes()),
            Self::F32(v) => tagged(out, b'f', &v.to_be_bytes()),
            Self::F64(v) => tagged(out, b'd', &v.to_be_bytes()),
            Self::Decimal(scale, v) => {
                out.extend_from_slice(&[b'D', *scale]);
                out.extend_from_slice(&v.to_be_bytes());
            }
            Self::LongString(s) => {
                out.push(b'S');
                long_bytes(out, s);
            }
            Self::Bytes(s) => {
                out.push(b'x');
                long_bytes(out, s);
            }
            Self::Timestamp(t) => tagged(out, b'T', &t.to_be_bytes()),
            Self::Void => out.push(b'V'),
            Self::Array(items) => {
                let mut content = Vec::new();
                for item in items {
                    item.encode(&mut content);
                }
                out.push(b'A');
                long_bytes(out, &content);
            }
            Self::Table(entries) => {
                out.push(b'F');
                long_bytes(out, &table(entries));
            }
            Self::Deep { levels, tables } => {
                // Each level: its letter, the length of what it holds, and
                // (in a table) the one entry's key before the next level.
                let per = if *tables { 7 } else { 5 };
                out.reserve(per * levels);
                for level in 1..=*levels {
                    if *tables && level > 1 {
                        out.extend_from_slice(&[1, b't']);
                    }
                    out.push(if *tables { b'F' } else { b'A' });
                    let inside = per * (levels - level);
                    out.extend_from_slice(&(inside as u32).to_be_bytes());
                }
            }
            Self::Raw(letter, bytes) => {
                out.push(*letter);
                out.extend_from_slice(bytes);
            }
        }
    }
}

fn tagged(out: &mut Vec<u8>, letter: u8, bytes: &[u8]) {
    out.push(letter);
    out.extend_from_slice(bytes);
}

/// A header table's content (without its length) from its entries, in
/// order, keys as raw bytes.
pub fn table(entries: &[(Vec<u8>, Field)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (key, value) in entries {
        short_bytes(&mut out, key);
        value.encode(&mut out);
    }
    out
}

/// Appends an AMQP short string (at most 255 bytes: longer is cut).
pub fn short_string(out: &mut Vec<u8>, s: &str) {
    short_bytes(out, s.as_bytes());
}

/// Appends an AMQP short string of raw bytes (at most 255: longer is cut).
pub fn short_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    let bytes = &bytes[..bytes.len().min(255)];
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

/// Appends a u32-length-prefixed byte string (a long string, a table's or
/// an array's content).
pub fn long_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// A header table's content: one entry `name` holding `levels` arrays
/// nested in each other (5 bytes a level).
pub fn nested_arrays(name: &str, levels: usize) -> Vec<u8> {
    let mut table = Vec::with_capacity(5 * levels + name.len() + 1);
    short_string(&mut table, name);
    for level in 1..=levels {
        table.push(b'A');
        table.extend_from_slice(&((5 * (levels - level)) as u32).to_be_bytes());
    }
    table
}

/// A header table's content: `count` long-string entries of `size` bytes.
pub fn wide_table(count: usize, size: usize) -> Vec<u8> {
    let mut table = Vec::new();
    for i in 0..count {
        short_string(&mut table, &format!("x-pad-{i}"));
        table.push(b'S');
        long_bytes(&mut table, &vec![b'p'; size]);
    }
    table
}

/// One connection with one channel in confirm mode.
pub struct RawPublisher {
    socket: TcpStream,
    frame_max: u32,
    /// Messages published so far (delivery tags are 1, 2, …).
    published: u64,
    /// Published messages the broker has not confirmed yet.
    unconfirmed: BTreeSet<u64>,
    /// Messages the broker nacked, not yet reported.
    nacked: Vec<u64>,
}

impl RawPublisher {
    /// Connects to the tests' RabbitMQ ([`crate::amqp`]) as its URL's user.
    pub async fn connect() -> Result<Self, RawError> {
        let (user, password) = crate::amqp_login();
        Self::connect_to(crate::amqp_address(), user, password).await
    }

    /// Connects to `addr` with PLAIN credentials.
    pub async fn connect_to(addr: &str, user: &str, password: &str) -> Result<Self, RawError> {
        let mut socket = TcpStream::connect(addr).await?;
        socket.set_nodelay(true)?;
        socket.write_all(b"AMQP\x00\x00\x09\x01").await?;
        let mut p = Self {
            socket,
            frame_max: FRAME_MAX,
            published: 0,
            unconfirmed: BTreeSet::new(),
            nacked: Vec::new(),
        };
        p.expect_method(0, (10, 10)).await?; // connection.start
        let mut start_ok = method(10, 11);
        long_bytes(&mut start_ok, &[]); // client properties
        short_string(&mut start_ok, "PLAIN");
        long_bytes(&mut start_ok, format!("\0{user}\0{password}").as_bytes());
        short_string(&mut start_ok, "en_US");
        p.send_frame(FRAME_METHOD, 0, &start_ok).await?;
        let tune = p.expect_method(0, (10, 30)).await?;
        // As large as the server lets a publisher send.
        let server_max = u32::from_be_bytes([tune[6], tune[7], tune[8], tune[9]]);
        if server_max != 0 {
            p.frame_max = server_max;
        }
        let mut tune_ok = method(10, 31);
        tune_ok.extend_from_slice(&tune[4..6]); // channel max
        tune_ok.extend_from_slice(&p.frame_max.to_be_bytes());
        tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeat
        p.send_frame(FRAME_METHOD, 0, &tune_ok).await?;
        let mut open = method(10, 40);
        short_string(&mut open, "/");
        short_string(&mut open, "");
        open.push(0);
        p.send_frame(FRAME_METHOD, 0, &open).await?;
        p.expect_method(0, (10, 41)).await?;
        let mut channel_open = method(20, 10);
        short_string(&mut channel_open, "");
        p.send_frame(FRAME_METHOD, 1, &channel_open).await?;
        p.expect_method(1, (20, 11)).await?;
        let mut select = method(85, 10);
        select.push(0);
        p.send_frame(FRAME_METHOD, 1, &select).await?;
        p.expect_method(1, (85, 11)).await?;
        Ok(p)
    }

    /// The frame size the broker agreed to.
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// Publishes `body` with `properties` to the default exchange, routing
    /// key `queue`, and waits for the broker's confirm.
    pub async fn publish(
        &mut self,
        queue: &str,
        properties: &Properties,
        body: &[u8],
    ) -> Result<(), RawError> {
        let tag = self.send(queue, properties, body).await?;
        let nacked = self.wait_confirms().await?;
        if nacked.contains(&tag) {
            return Err(RawError::Nacked);
        }
        Ok(())
    }

    /// Publishes `body` with `properties` to the default exchange, routing
    /// key `queue`, without waiting for its confirm: its delivery tag,
    /// for [`RawPublisher::wait_confirms`].
    pub async fn send(
        &mut self,
        queue: &str,
        properties: &Properties,
        body: &[u8],
    ) -> Result<u64, RawError> {
        let mut publish = method(60, 40);
        publish.extend_from_slice(&0u16.to_be_bytes());
        short_string(&mut publish, "");
        short_string(&mut publish, queue);
        publish.push(0); // not mandatory: the tests' queues exist
        // One write for the method, the content header and the body.
        let mut frames = Vec::with_capacity(64 + properties.list.len() + body.len());
        frame(&mut frames, FRAME_METHOD, 1, &publish);
        let mut header = Vec::with_capacity(14 + properties.list.len());
        header.extend_from_slice(&60u16.to_be_bytes());
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&properties.flags.to_be_bytes());
        header.extend_from_slice(&properties.list);
        frame(&mut frames, FRAME_HEADER, 1, &header);
        for chunk in body.chunks(self.frame_max as usize - 8) {
            frame(&mut frames, FRAME_BODY, 1, chunk);
        }
        self.socket.write_all(&frames).await?;
        self.published += 1;
        self.unconfirmed.insert(self.published);
        Ok(self.published)
    }

    /// Waits until the broker has confirmed every message sent: the tags
    /// it nacked (one ack may confirm many: `multiple`). An error if the
    /// broker closed the channel or the connection first.
    pub async fn wait_confirms(&mut self) -> Result<Vec<u64>, RawError> {
        while !self.unconfirmed.is_empty() {
            let (channel, payload) = self.read_frame().await?;
            let settled = match class_method(&payload) {
                Some((60, 80)) => false,
                Some((60, 120)) => true,
                _ => return Err(self.closed_or_unexpected(channel, &payload).await),
            };
            if payload.len() < 13 {
                return Err(RawError::Protocol("a short basic.ack".into()));
            }
            let tag = u64::from_be_bytes(payload[4..12].try_into().unwrap_or_default());
            let multiple = payload[12] & 1 == 1;
            let done: Vec<u64> = if multiple {
                self.unconfirmed.range(..=tag).copied().collect()
            } else {
                vec![tag]
            };
            for t in done {
                if self.unconfirmed.remove(&t) && settled {
                    self.nacked.push(t);
                }
            }
        }
        Ok(std::mem::take(&mut self.nacked))
    }

    /// Closes the connection politely.
    pub async fn close(mut self) {
        let mut close = method(10, 50);
        close.extend_from_slice(&200u16.to_be_bytes());
        short_string(&mut close, "bye");
        close.extend_from_slice(&[0, 0, 0, 0]);
        if self.send_frame(FRAME_METHOD, 0, &close).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.read_frame()).await;
        }
    }

    async fn expect_method(&mut self, channel: u16, id: (u16, u16)) -> Result<Vec<u8>, RawError> {
        loop {
            let (ch, payload) = self.read_frame().await?;
            if ch == channel && class_method(&payload) == Some(id) {
                return Ok(payload);
            }
            if class_method(&payload).is_some_and(|(c, m)| m == 40 && (c == 10 || c == 20)) {
                return Err(self.closed_or_unexpected(ch, &payload).await);
            }
        }
    }

    async fn closed_or_unexpected(&mut self, channel: u16, payload: &[u8]) -> RawError {
        match class_method(payload) {
            Some((c @ (10 | 20), 40)) if payload.len() >= 7 => {
                let code = u16::from_be_bytes([payload[4], payload[5]]);
                let len = payload[6] as usize;
                let text = String::from_utf8_lossy(&payload[7..(7 + len).min(payload.len())]);
                // Answer close-ok, as the protocol asks.
                let _ = self.send_frame(FRAME_METHOD, channel, &method(c, 41)).await;
                RawError::Closed(code, text.into_owned())
            }
            other => {
                RawError::Protocol(format!("unexpected method {other:?} on channel {channel}"))
            }
        }
    }

    async fn send_frame(&mut self, kind: u8, channel: u16, payload: &[u8]) -> Result<(), RawError> {
        let mut out = Vec::with_capacity(payload.len() + 8);
        frame(&mut out, kind, channel, payload);
        self.socket.write_all(&out).await?;
        Ok(())
    }

    /// The next frame other than a heartbeat: its channel and payload.
    async fn read_frame(&mut self) -> Result<(u16, Vec<u8>), RawError> {
        loop {
            let mut head = [0u8; 7];
            tokio::time::timeout(Duration::from_secs(30), self.socket.read_exact(&mut head))
                .await
                .map_err(|_| RawError::Protocol("no frame within 30 s".into()))??;
            let channel = u16::from_be_bytes([head[1], head[2]]);
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0u8; size + 1];
            self.socket.read_exact(&mut payload).await?;
            payload.pop();
            if head[0] != 8 {
                return Ok((channel, payload));
            }
        }
    }
}

/// Appends one frame.
fn frame(out: &mut Vec<u8>, kind: u8, channel: u16, payload: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.push(FRAME_END);
}

/// A method frame's payload start: class and method ids.
fn method(class: u16, method: u16) -> Vec<u8> {
    let mut m = class.to_be_bytes().to_vec();
    m.extend_from_slice(&method.to_be_bytes());
    m
}

fn class_method(payload: &[u8]) -> Option<(u16, u16)> {
    (payload.len() >= 4).then(|| {
        (
            u16::from_be_bytes([payload[0], payload[1]]),
            u16::from_be_bytes([payload[2], payload[3]]),
        )
    })
}
