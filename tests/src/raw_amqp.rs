//! A publisher that writes AMQP 0-9-1 frames by hand, for the attack tests:
//! it sends properties and headers as raw bytes, so a test can send what no
//! client library would encode (header tables nested thousands of levels
//! deep, header frames larger than a consumer's `frame_max`, broken
//! encodings) and see what the broker lets through to sas.
//!
//! Only what a publisher needs: the handshake (PLAIN, guest), one channel in
//! confirm mode, `basic.publish` with a content header and body frames.

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

/// Appends an AMQP short string (at most 255 bytes: longer is cut).
pub fn short_string(out: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(255)];
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
    /// Confirms received so far (delivery tags are 1, 2, …).
    published: u64,
}

impl RawPublisher {
    /// Connects to RabbitMQ on 127.0.0.1:5672 as guest.
    pub async fn connect() -> Result<Self, RawError> {
        Self::connect_to("127.0.0.1:5672", "guest", "guest").await
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
        let mut publish = method(60, 40);
        publish.extend_from_slice(&0u16.to_be_bytes());
        short_string(&mut publish, "");
        short_string(&mut publish, queue);
        publish.push(0); // not mandatory: the tests' queues exist
        self.send_frame(FRAME_METHOD, 1, &publish).await?;
        let mut header = Vec::with_capacity(14 + properties.list.len());
        header.extend_from_slice(&60u16.to_be_bytes());
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&properties.flags.to_be_bytes());
        header.extend_from_slice(&properties.list);
        self.send_frame(FRAME_HEADER, 1, &header).await?;
        for chunk in body.chunks(self.frame_max as usize - 8) {
            self.send_frame(FRAME_BODY, 1, chunk).await?;
        }
        self.published += 1;
        loop {
            let (channel, payload) = self.read_frame().await?;
            match class_method(&payload) {
                Some((60, 80)) => {
                    let tag = u64::from_be_bytes(payload[4..12].try_into().unwrap_or_default());
                    if tag >= self.published {
                        return Ok(());
                    }
                }
                Some((60, 120)) => return Err(RawError::Nacked),
                _ => return Err(self.closed_or_unexpected(channel, &payload).await),
            }
        }
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
        let mut frame = Vec::with_capacity(payload.len() + 8);
        frame.push(kind);
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(FRAME_END);
        self.socket.write_all(&frame).await?;
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
